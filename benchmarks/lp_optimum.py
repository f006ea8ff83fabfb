"""How far from optimal: each verifier's exact E[accepted] against the best any
lossless verifier can do with the same draft scheme.

For a small synthetic case (random target/draft next-token laws per prefix,
vocabulary <= 6, depth <= 3) every draft tree T of the scheme is enumerated
with its probability P(T). A verifier is any conditional law x[T, e, y] of
(end node, next token) given the tree, so the optimum is a linear program:

    maximise    sum_{T,e,y} x[T,e,y] depth(e)
    subject to  sum_{e,y} x[T,e,y] = P(T)                              (each tree)
                sum_{(T,e,y) prefix of s} x[T,e,y] p(rest of s | prefix) = P_target(s)
                                                                       (each string s of length D+1)
                (divided by P_target(s) for scaling; see ``lp_optimum``)
                x >= 0,

solved with SciPy's HiGHS. The verifiers' values come from ``outcome_law``.

    python -m benchmarks.lp_optimum            # writes benchmarks/results/lp_optimum.md
"""

from __future__ import annotations

import itertools
import sys
import time
from pathlib import Path

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix

from vllm_univer import TreeSpec
from vllm_univer.tools.law_oracle import PathModel, enumerate_trees, expected_accepted, node_paths

ROOT = Path(__file__).resolve().parent

SCHEME_METHODS = {
    "chain": ("token", "block"),
    "iid": ("rrs", "target_only"),
    "wor": ("rrsw", "traversal", "univer_wor", "target_only"),
    "topk1": ("greedy", "univer", "target_only"),
}


def lp_optimum(scheme: str, tree: TreeSpec, target: PathModel, draft: PathModel) -> float:
    """Optimal E[accepted] over all lossless verifiers of ``scheme`` drafts on ``tree``.

    Losslessness is written per full string s with P_target(s) > 0 as
    sum_k m(s_<=k) / P_target(s_<=k) = 1 (m = output mass on that prefix), which
    keeps the constraint matrix well scaled; outputs whose prefix has target
    probability 0 get no variable (they would produce impossible strings).
    """
    trees = enumerate_trees(scheme, tree, draft)
    vocab, length = target.vocab, tree.max_depth + 1
    depth = tree.depth.tolist()

    def prob(prefix):
        pr = 1.0
        for k in range(len(prefix)):
            pr *= target(prefix[:k])[prefix[k]]
        return pr

    strings = [s for s in itertools.product(range(vocab), repeat=length) if prob(s) > 0]
    string_index = {s: i for i, s in enumerate(strings)}
    extensions: dict[tuple, list[int]] = {}

    def strings_extending(prefix):
        if prefix not in extensions:
            extensions[prefix] = [
                string_index[prefix + rest]
                for rest in itertools.product(range(vocab), repeat=length - len(prefix))
                if prefix + rest in string_index
            ]
        return extensions[prefix]

    rows, cols, vals, objective = [], [], [], []
    n_strings = len(strings)
    var = 0
    for b, (_, tokens) in enumerate(trees):
        for e, path in enumerate(node_paths(tree, tokens)):
            if path is None:
                continue
            for y in range(vocab):
                prefix = path + (y,)
                pr = prob(prefix)
                if pr == 0:
                    continue
                for s in strings_extending(prefix):
                    rows.append(s)
                    cols.append(var)
                    vals.append(1.0 / pr)
                rows.append(n_strings + b)
                cols.append(var)
                vals.append(1.0)
                objective.append(depth[e])
                var += 1
    a_eq = coo_matrix((vals, (rows, cols)), shape=(n_strings + len(trees), var)).tocsr()
    b_eq = np.concatenate([np.ones(n_strings), [pr for pr, _ in trees]])
    # HiGHS' presolve declares some of these (feasible: every lossless verifier is a
    # solution) problems infeasible on round-off; the solver itself handles them.
    res = linprog(
        -np.array(objective, dtype=float),
        A_eq=a_eq,
        b_eq=b_eq,
        bounds=(0, None),
        method="highs",
        options={"presolve": False},
    )
    if res.status != 0:
        raise RuntimeError(f"LP failed: {res.message}")
    return -res.fun


CASES = [
    ("chain", "1x3", 4),
    ("iid", "2x2", 3),
    ("wor", "2x1", 6),
    ("wor", "3x1", 5),
    ("wor", "3x1", 6),
    ("wor", "4x1", 5),
    ("wor", "2x2", 4),
    ("wor", "2x2", 5),
    ("wor", "skewed-2", 4),
    ("wor", "skewed-chain", 4),
    ("wor", "eagle-like", 4),
    ("topk1", "2x2", 4),
    ("topk1", "2x3", 4),
    ("topk1", "3x2", 5),
]
# Irregular trees, subtrees of different sizes side by side (paths of child slots):
# two leaves below slot 0 beside a leaf; a chain of two beside a leaf; three children
# with 2, 1 and 0 children of their own, as EAGLE's trees thin out away from rank 0.
IRREGULAR_SHAPES = {
    "skewed-2": [(0,), (1,), (0, 0), (0, 1)],
    "skewed-chain": [(0,), (1,), (0, 0), (0, 0, 0)],
    "eagle-like": [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)],
}


def tree_of(shape: str) -> TreeSpec:
    if shape in IRREGULAR_SHAPES:
        return TreeSpec.from_paths(IRREGULAR_SHAPES[shape])
    return TreeSpec.parse(shape)


COLUMNS = max(len(m) for m in SCHEME_METHODS.values())


class PeakedModel(PathModel):
    """Peaked laws, like a real pair's: a Dirichlet(0.8) row raised to the power
    ``power`` (1 / 0.35 by default: top token usually 0.6-0.95), plus 2e-3 per token
    after normalising (the LP divides by string probabilities); with a ``base``, the
    row is 70 % the base's on 80 % of prefixes (a draft that mostly agrees with the
    target)."""

    def __init__(self, vocab: int, seed: int, base: PeakedModel | None = None, power: float = 1 / 0.35):
        super().__init__(vocab, seed, zeros=False, ties=False, base=base)
        self.power = power

    def _draw(self, rng: np.random.Generator, prefix: tuple) -> np.ndarray:
        row = rng.dirichlet(np.full(self.vocab, 0.8)) ** self.power
        row = row / row.sum() + 2e-3
        row = row / row.sum()
        if self.base is not None and rng.random() < 0.8:
            row = 0.3 * row + 0.7 * self.base(prefix)
        return row / row.sum()


def peaked_pair(vocab: int, seed: int, power: float = 1 / 0.35) -> tuple[PeakedModel, PeakedModel]:
    """A peaked target and a draft that mostly agrees with it (the `peaked` kind)."""
    target = PeakedModel(vocab, 1000 + seed, power=power)
    return target, PeakedModel(vocab, 2000 + seed, base=target, power=power)


# "generic": smooth random laws, draft independent of the target.
# "zeros+ties": laws with exact zeros and ties, draft a 50/50 mix with the target
# on 70% of prefixes (the test suite's stress models).
# "peaked": peaked laws, the draft mostly the target's (``PeakedModel``).
MODEL_KINDS = {
    "generic": lambda vocab, seed: (
        PathModel(vocab, 1000 + seed, zeros=False, ties=False),
        PathModel(vocab, 2000 + seed, zeros=False, ties=False),
    ),
    "zeros+ties": lambda vocab, seed: (lambda t: (t, PathModel(vocab, 2000 + seed, base=t)))(
        PathModel(vocab, 1000 + seed)
    ),
    "peaked": peaked_pair,
}


def optimum_and_methods(scheme: str, tree: TreeSpec, pairs, methods, label=()) -> tuple[float, dict[str, float]]:
    """(mean LP optimum, {method: mean E[accepted]}) over ``pairs`` of (target, draft)
    models, each method checked against the optimum of each pair (``label`` names the
    case in the failure)."""
    opt, values = [], {m: [] for m in methods}
    for i, (target, draft) in enumerate(pairs):
        opt.append(lp_optimum(scheme, tree, target, draft))
        for m in values:
            values[m].append(expected_accepted(m, scheme, tree, target, draft))
            # Every lossless verifier is feasible for the LP: it cannot beat the optimum.
            assert values[m][-1] <= opt[-1] + 1e-7, (*label, i, m, values[m][-1], opt[-1])
    return float(np.mean(opt)), {m: float(np.mean(v)) for m, v in values.items()}


def main() -> None:
    seeds = range(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
    lines = [
        "# Gap to the optimal lossless verifier (exact, synthetic)",
        "",
        f"Command: `python -m benchmarks.lp_optimum {' '.join(sys.argv[1:])}`",
        "",
        "E[accepted draft tokens] averaged over the scheme's trees, mean over "
        f"{len(seeds)} random target/draft pairs per case. Models: `generic` = smooth random laws, "
        "draft independent of the target; `zeros+ties` = laws with exact zeros and ties, draft mixed "
        "with the target (the test suite's stress models); `peaked` = peaked laws like a real pair's, "
        "the draft mostly agreeing with the target (`PeakedModel`). "
        "`LP` is the optimum over all lossless verifiers for the same drafts (HiGHS); "
        "the ratio column is method / LP. Irregular trees (paths of child slots): "
        + "; ".join(f"`{name}` {paths}" for name, paths in IRREGULAR_SHAPES.items())
        + ".",
        "",
        "| models | scheme | tree | V | LP | " + " | ".join(["method", "E[acc]", "/ LP"] * COLUMNS) + " |",
        "|---|---|---|---|---|" + "---|---|---|" * COLUMNS,
    ]
    shares = []  # (univer_wor, traversal) / LP per wor case
    for kind, scheme, shape, vocab in [(k, *c) for k in MODEL_KINDS for c in CASES]:
        tree = tree_of(shape)
        t0 = time.time()
        pairs = [MODEL_KINDS[kind](vocab, seed) for seed in seeds]
        lp, values = optimum_and_methods(scheme, tree, pairs, SCHEME_METHODS[scheme], (kind, scheme, shape))
        cells = []
        for m, v in values.items():
            cells += [m, f"{v:.4f}", f"{v / lp:.4f}"]
        cells += [""] * (3 * COLUMNS - len(cells))
        if scheme == "wor":
            shares.append((values["univer_wor"] / lp, values["traversal"] / lp))
        lines.append(f"| {kind} | {scheme} | {shape} | {vocab} | {lp:.4f} | " + " | ".join(cells) + " |")
        print(lines[-1], f"({time.time() - t0:.0f}s)", flush=True)
    new, old = min(s for s, _ in shares), min(t for _, t in shares)
    lines += [
        "",
        f"NEW univer_wor: worst share of the LP optimum on wor cases = {100 * new:.1f} % "
        f"(traversal: {100 * old:.1f} %)",
    ]
    print(lines[-1])
    out = ROOT / "results" / "lp_optimum.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
