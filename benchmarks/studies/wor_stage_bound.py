"""Why ``univer_wor`` stays below the one-step optimum with three children drawn
without replacement: a bound on every verifier that takes the children in stages.

``univer_wor`` used to verify three children in stages: the pair in slots 1-2 with
its one-step coupling (optimal for two children: the 2x1 rows of
``lp_optimum.md`` are at 100 %), then slot 3 alone against what is left. At
depth 1 (tree 3x1) this script keeps the pair stage exactly as ``univer_wor``
runs it on two children (its exact law on the 2x1 tree) and lets a linear program choose the best
possible rule for slot 3 given the drawn tokens (any dependence on x1, x2, x3
allowed, any leftover law per pair). The other order too: slot 1 alone first (the
block step ``univer_wor`` uses for a lone slot), then the best possible rule for
slots 2-3 together. Both are upper bounds for their structure; ``LP`` is the
optimum over all lossless verifiers (``lp_optimum.py``). Both stay near 93 % on
smooth laws: that is why ``univer_wor`` now lets x3 go first when its ratio is the
best of the three (``_FirstOfThree``); its column shows what that reaches.

    python -m benchmarks.studies.wor_stage_bound    # writes benchmarks/results/wor_stage_bound.md
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix

from benchmarks.lp_optimum import MODEL_KINDS, lp_optimum
from vllm_univer import TreeSpec
from vllm_univer.tools.law_oracle import expected_accepted, scheme_outcomes, step_law_over_trees

ROOT = Path(__file__).resolve().parents[1]  # benchmarks/


def best_completion(p: np.ndarray, delivered: np.ndarray, reached: list[tuple[tuple, float, tuple]]) -> float:
    """Most extra acceptance any rule can add after a first stage.

    ``delivered`` [V]: the first token's law the first stage already produced;
    ``reached``: (drawn tokens, P(drawn and the first stage rejected them all),
    tokens the rest may still accept). Variables x[i, y] >= 0: P(drawn i, first
    stage rejected, output y); sum_y x[i, y] = its mass; sum_i x[i, y] = p(y) -
    delivered(y); maximise the mass on acceptable tokens.
    """
    vocab = len(p)
    rows, cols, objective, b_eq = [], [], np.zeros(len(reached) * vocab), []
    for i, (_, mass, acceptable) in enumerate(reached):
        for y in range(vocab):
            rows += [i, len(reached) + y]
            cols += [i * vocab + y] * 2
        objective[[i * vocab + y for y in acceptable]] = 1.0  # (an empty list selects nothing)
        b_eq.append(mass)
    b_eq += list(np.clip(p - delivered, 0.0, None))
    a_eq = coo_matrix((np.ones(len(rows)), (rows, cols)), shape=(len(b_eq), len(objective))).tocsr()
    res = linprog(-objective, A_eq=a_eq, b_eq=b_eq, bounds=(0, None), method="highs", options={"presolve": False})
    if res.status != 0:
        raise RuntimeError(f"LP failed: {res.message}")
    return -res.fun


def pair_then_best(target, draft) -> float:
    """univer_wor's pair stage (slots 1-2), then the best rule for slot 3."""
    p, q = target(()), draft(())
    probs, tokens, law = step_law_over_trees("univer_wor", "wor", TreeSpec.parse("2x1"), target, draft)
    accept = {tuple(t[1:].tolist()): law[b, 1:].sum(-1) for b, t in enumerate(tokens)}  # per pair: [a, b]
    delivered = np.zeros(len(p))
    for pr, t in zip(probs, tokens):
        for x, a in zip(t[1:].tolist(), accept[tuple(t[1:].tolist())]):
            delivered[x] += pr * a if x >= 0 else 0.0
    reached = [
        (xs, pr * (1.0 - accept[xs[:2]].sum()), [x for x in xs[2:] if x >= 0])
        for xs, pr in scheme_outcomes("wor", q, 3)
    ]
    return float(delivered.sum()) + best_completion(p, delivered, reached)


def lone_then_best(target, draft) -> float:
    """Slot 1 alone (block step min(1, p/q)), then the best rule for slots 2-3."""
    p, q = target(()), draft(())
    take = np.where(q > 0, np.minimum(1.0, p / np.where(q > 0, q, 1.0)), 0.0)
    delivered = q * take
    reached = [(xs, pr * (1.0 - take[xs[0]]), [x for x in xs[1:] if x >= 0]) for xs, pr in scheme_outcomes("wor", q, 3)]
    return float(delivered.sum()) + best_completion(p, delivered, reached)


def main() -> None:
    seeds = range(int(sys.argv[1]) if len(sys.argv) > 1 else 6)
    tree = TreeSpec.parse("3x1")
    lines = [
        "# Three children drawn without replacement: what stages can reach (exact, synthetic)",
        "",
        f"Command: `python -m benchmarks.studies.wor_stage_bound {' '.join(sys.argv[1:])}`",
        "",
        "Tree 3x1 (depth 1), E[accepted] as a share of the LP optimum over all lossless verifiers, "
        f"mean over {len(seeds)} random target/draft pairs (worst pair in brackets); models as in "
        "`lp_optimum.md`. `pair, then best` keeps univer_wor's two-child stage and gives slot 3 the best "
        "possible rule (a linear program over every rule that sees x1, x2, x3); `lone, then best` "
        "verifies slot 1 alone first, then the best possible rule for slots 2-3. `univer_wor` tries "
        "x3 first when its ratio class is above both others' (with probability (1 - q1 - q2) / "
        "((1 - q1)(1 - q2))), then the pair, then x3 again: above both staged bounds.",
        "",
        "| models | V | LP | univer_wor | pair, then best | lone, then best | traversal |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind in MODEL_KINDS:
        for vocab in (4, 5, 6):
            values = {name: [] for name in ("univer_wor", "pair", "lone", "traversal")}
            optimum = []
            for seed in seeds:
                target, draft = MODEL_KINDS[kind](vocab, seed)
                optimum.append(lp_optimum("wor", tree, target, draft))
                values["univer_wor"].append(expected_accepted("univer_wor", "wor", tree, target, draft))
                values["traversal"].append(expected_accepted("traversal", "wor", tree, target, draft))
                values["pair"].append(pair_then_best(target, draft))
                values["lone"].append(lone_then_best(target, draft))
            cells = []
            for v in values.values():
                shares = np.array(v) / np.array(optimum)
                cells.append(f"{np.mean(v) / np.mean(optimum):.4f} ({shares.min():.4f})")
            lines.append(f"| {kind} | {vocab} | {np.mean(optimum):.4f} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    out = ROOT / "results" / "wor_stage_bound.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
