"""The exact-law oracle of the tests and the LP studies, written independently of the
verifier core's drafting and sampling code (it uses only ``outcome_law``).

* ``PathModel``: a random next-token distribution for every token prefix (a toy
  language model), with zeros and ties mixed in on purpose; ``NearlySurePathModel``:
  one whose top tokens hold all but a tail as small as 1e-30.
* ``scheme_outcomes``: every possible set of children of one node under a draft
  scheme, with its exact probability (plain Python, not ``draft_children``).
* ``enumerate_trees``: every draft tree of a scheme with its probability.
* ``output_law_check``: push a verifier's exact step law through target
  sampling to strings of length D+1 and compare with the target's own law.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import numpy as np
import torch

from vllm_univer import TreeSpec, outcome_law


class PathModel:
    """p(. | prefix) for token prefixes, float64, drawn lazily and cached.

    zeros: some entries are exactly 0; ties: some rows have equal entries;
    base: another PathModel to mix with (a draft that resembles the target).
    """

    def __init__(self, vocab: int, seed: int, zeros: bool = True, ties: bool = True, base=None, onehot=False):
        self.vocab = vocab
        self.seed = seed
        self.zeros, self.ties, self.base, self.onehot = zeros, ties, base, onehot
        self.cache: dict[tuple, np.ndarray] = {}

    def __call__(self, prefix) -> np.ndarray:
        prefix = tuple(int(t) for t in prefix)
        row = self.cache.get(prefix)
        if row is None:
            row = self._draw(np.random.default_rng([self.seed, len(prefix), *prefix]), prefix)
            self.cache[prefix] = row
        return row

    def _draw(self, rng: np.random.Generator, prefix: tuple) -> np.ndarray:
        """The row of ``prefix`` from its own generator (subclasses draw other laws)."""
        if self.onehot:
            row = np.zeros(self.vocab)
            row[rng.integers(self.vocab)] = 1.0
            return row
        row = rng.dirichlet(np.full(self.vocab, 0.8))
        if self.base is not None and rng.random() < 0.7:
            row = 0.5 * row + 0.5 * self.base(prefix)
        if self.zeros and rng.random() < 0.4:
            row[rng.choice(self.vocab, size=rng.integers(1, self.vocab - 1), replace=False)] = 0.0
        if self.ties and rng.random() < 0.4:
            i, j = rng.choice(self.vocab, size=2, replace=False)
            row[i] = row[j] = max(row[i], row[j])
        return row / row.sum()


class NearlySurePathModel(PathModel):
    """Rows whose ``top`` most likely tokens hold all but ``tail`` of the mass (the
    rest spread by a Dirichlet draw, exact zeros in some rows): a draft or a target
    that is nearly sure, down to tails of 1e-30, where a mass computed as a total
    minus a part cancels. ``sure_of``: a PathModel whose LEAST likely token (ties: the
    highest id) is made this row's top token (a target sure of what the draft nearly
    excludes)."""

    def __init__(self, vocab: int, seed: int, tail: float, top: int = 1, sure_of: PathModel | None = None):
        super().__init__(vocab, seed)
        self.tail, self.top, self.sure_of = tail, top, sure_of

    def _draw(self, rng: np.random.Generator, prefix: tuple) -> np.ndarray:
        order = rng.permutation(self.vocab)
        if self.sure_of is not None:
            other = self.sure_of(prefix)
            least = max(range(self.vocab), key=lambda t: (-other[t], t))
            order = np.concatenate([[least], order[order != least]])
        head, rest = order[: self.top], order[self.top :]
        row = np.zeros(self.vocab)
        row[head] = (1.0 - self.tail) * rng.dirichlet(np.ones(self.top))
        spread = rng.dirichlet(np.full(len(rest), 0.8))
        if rng.random() < 0.4 and len(rest) > 1:
            spread[rng.integers(len(rest))] = 0.0  # an exact zero in the tail
        row[rest] = self.tail * spread / spread.sum()
        return row


def top_set(q: np.ndarray, k: int) -> list[int]:
    """Top-k tokens by probability, ties to the lower id."""
    return sorted(range(len(q)), key=lambda t: (-q[t], t))[:k]


def scheme_outcomes(scheme: str, q: np.ndarray, m: int):
    """Yield (children tokens in slot order, probability) for every outcome with probability > 0."""
    vocab = len(q)
    if scheme == "chain":
        assert m == 1
        for x in range(vocab):
            if q[x] > 0:
                yield (x,), q[x]
    elif scheme == "iid":
        for xs in itertools.product(range(vocab), repeat=m):
            pr = float(np.prod([q[x] for x in xs]))
            if pr > 0:
                yield xs, pr
    elif scheme == "wor":
        support = [t for t in range(vocab) if q[t] > 0]
        k = min(m, len(support))
        for xs in itertools.permutations(support, k):
            pr, left = 1.0, set(support)
            for x in xs:
                # The mass left is a sum over the tokens left (1 - used cancels
                # when the first draws hold all but ~1e-16 of the mass).
                pr *= q[x] / sum(q[t] for t in sorted(left))
                left.discard(x)
            yield tuple(xs) + (-1,) * (m - k), pr
    elif scheme == "topk1":
        top = top_set(q, m - 1)
        rest = q.copy()
        rest[top] = 0.0
        if rest.sum() <= 0:
            yield (-1, *top), 1.0
        else:
            rest = rest / rest.sum()
            for r in range(vocab):
                if rest[r] > 0:
                    yield (r, *top), rest[r]
    else:
        raise AssertionError(scheme)


def node_paths(tree: TreeSpec, tokens) -> list[tuple]:
    """Token path from the root to every node (None for missing nodes)."""
    parent = tree.parent.tolist()
    out: list = [()]
    for i in range(1, tree.num_nodes + 1):
        up = out[parent[i]]
        out.append(None if up is None or tokens[i] < 0 else up + (int(tokens[i]),))
    return out


def enumerate_trees(scheme: str, tree: TreeSpec, draft: PathModel, context=()):
    """All draft trees of ``scheme`` on ``tree``: list of (probability, tokens [N+1])."""
    children = [[c for c in row if c >= 0] for row in tree.children.tolist()]
    internal = [v for v in range(tree.num_nodes + 1) if children[v]]
    results = []

    def rec(k: int, tokens: list, paths: dict, prob: float):
        if k == len(internal):
            results.append((prob, list(tokens)))
            return
        v = internal[k]
        if paths.get(v) is None:  # missing node: its children are missing too
            rec(k + 1, tokens, paths, prob)
            return
        kids = children[v]
        for xs, pr in scheme_outcomes(scheme, draft(context + paths[v]), len(kids)):
            for c, x in zip(kids, xs):
                tokens[c] = x
                paths[c] = None if x < 0 else paths[v] + (x,)
            rec(k + 1, tokens, paths, prob * pr)
            for c in kids:
                tokens[c] = -1
                paths.pop(c, None)

    rec(0, [-1] * (tree.num_nodes + 1), {0: ()}, 1.0)
    return results


def batch_tensors(tree: TreeSpec, token_lists, target: PathModel, draft: PathModel, context=(), dtype=torch.float64):
    """(tokens [B, N+1], p [B, N+1, V], q [B, N+1, V]) for given trees; missing rows are 0."""
    vocab = target.vocab
    n1 = tree.num_nodes + 1
    tokens = torch.tensor(token_lists, dtype=torch.long).reshape(-1, n1)
    p = np.zeros((len(token_lists), n1, vocab))
    q = np.zeros_like(p)
    for b, toks in enumerate(token_lists):
        for i, path in enumerate(node_paths(tree, toks)):
            if path is not None:
                p[b, i] = target(context + path)
                q[b, i] = draft(context + path)
    return tokens, torch.tensor(p, dtype=dtype), torch.tensor(q, dtype=dtype)


def step_law_over_trees(method, scheme, tree, target, draft):
    """(tree probs [B], tokens [B, N+1], exact step law [B, N+1, V]) over every tree of the scheme."""
    trees = enumerate_trees(scheme, tree, draft)
    probs = np.array([pr for pr, _ in trees])
    tokens, p, q = batch_tensors(tree, [t for _, t in trees], target, draft)
    law = outcome_law(method, tree, tokens, p, q).numpy()
    return probs, tokens, law


def string_law_error(method, scheme, tree, target, draft) -> float:
    """max |P_spec(s) - P_target(s)| over strings s of length D+1 (float64, exact)."""
    probs, tokens, law = step_law_over_trees(method, scheme, tree, target, draft)
    length = tree.max_depth + 1
    mass: dict[tuple, float] = defaultdict(float)
    for b in range(len(probs)):
        paths = node_paths(tree, tokens[b].tolist())
        rows = np.nonzero(law[b].sum(-1) > 0)[0]
        for e in rows:
            for y in np.nonzero(law[b, e] > 0)[0]:
                mass[paths[e] + (int(y),)] += probs[b] * law[b, e, y]
    return _string_error(mass, target, length)


def _string_error(mass: dict, target: PathModel, length: int) -> float:
    """max |mass(s) - P_target(s)| over strings s of ``length`` tokens, once the
    shorter outputs in ``mass`` (output string -> probability; consumed) are
    completed with target sampling, one length at a time."""
    for n in range(1, length):
        for s in [s for s in mass if len(s) == n]:
            m = mass.pop(s)
            row = target(s)
            for y in range(target.vocab):
                if row[y] > 0:
                    mass[s + (y,)] += m * row[y]
    worst = 0.0
    for s in itertools.product(range(target.vocab), repeat=length):
        exact = float(np.prod([target(s[:k])[s[k]] for k in range(length)]))
        worst = max(worst, abs(mass.pop(s, 0.0) - exact))
    assert not mass, f"outputs outside the vocabulary strings: {list(mass)[:3]}"
    return worst


def expected_accepted(method, scheme, tree, target, draft) -> float:
    """E[accepted draft tokens] averaged over the scheme's trees (exact)."""
    probs, _, law = step_law_over_trees(method, scheme, tree, target, draft)
    depth = tree.depth.numpy()
    return float((probs[:, None] * law.sum(-1) * depth[None, :]).sum())


def dynamic_trees(budget, draft: PathModel, keep_child=None, context=()):
    """Every context-aware ``topk1`` tree (``core.dynamic_tree``) with its probability:
    (trees, empty), trees a list of (probability, TreeSpec, tokens [N+1]), empty the
    probability that nothing is drafted. The child slots come from the
    package's own ``plan_children``; the draws are enumerated here (``scheme_outcomes``).
    ``keep_child(q_row, slot, token) -> bool``, if given, drops drawn children after
    the fact (a rule that is NOT lossless: the tests' negative control)."""
    from vllm_univer.core.dynamic_tree import level_sizes, plan_children

    results = []
    sizes = level_sizes(budget)  # a level's slot cap: the next level's positions

    def level(depth: int, frontier: list, nodes: dict, prob: float):
        # frontier: [(slot path, token path, score)] in layout order; nodes: slot path -> token
        if depth + 1 >= len(sizes) or not frontier:
            results.append((prob, dict(nodes)))
            return
        rows = [draft(context + tokens) for _, tokens, _ in frontier]
        q = torch.tensor(np.array(rows), dtype=torch.float64).unsqueeze(0)
        scores = torch.tensor([[s for _, _, s in frontier]], dtype=torch.float64)
        k = plan_children(scores, q, budget, torch.tensor([sizes[depth + 1]])).squeeze(0).tolist()
        expanded = [i for i in range(len(frontier)) if k[i] > 0]
        # Layout order of the next frontier: expanded nodes by score rank, then slot.
        expanded.sort(key=lambda i: (-frontier[i][2], i))
        choices = [list(scheme_outcomes("topk1", rows[i], k[i])) for i in expanded]
        for combo in itertools.product(*choices):
            pr, grown, nxt = prob, {}, []
            for i, (kids, p_kids) in zip(expanded, combo):
                spath, tpath, score = frontier[i]
                pr *= p_kids
                for slot, tok in enumerate(kids):
                    if tok >= 0 and keep_child is not None and not keep_child(rows[i], slot, tok):
                        tok = -1
                    grown[spath + (slot,)] = tok
                    if tok >= 0:
                        nxt.append((spath + (slot,), tpath + (tok,), score * rows[i][tok]))
            level(depth + 1, nxt, {**nodes, **grown}, pr)

    level(0, [((), (), 1.0)], {}, 1.0)
    out, empty = [], 0.0
    for prob, nodes in results:
        if not nodes:  # nothing drafted: the step samples one token from p
            empty += prob
            continue
        tree = TreeSpec.from_paths(list(nodes))
        tokens = [-1] + [nodes[p] for p in tree.paths[1:]]
        out.append((prob, tree, tokens))
    return out, empty


def tree_of_row(parent_row: list[int]) -> tuple[TreeSpec, dict[int, int]]:
    """One request of a ``TreeBatch`` as its own TreeSpec: (tree, position -> node id).
    parent_row: the request's parents [N+1] (-1: no node); its children are slotted
    by position."""
    paths = {0: ()}
    for pos, par in enumerate(parent_row):  # parents come before their children
        if pos > 0 and par >= 0:
            slot = sum(1 for other in range(1, pos) if parent_row[other] == par)
            paths[pos] = paths[par] + (slot,)
    tree = TreeSpec.from_paths([path for pos, path in paths.items() if pos > 0])
    index = {path: i for i, path in enumerate(tree.paths)}
    return tree, {pos: index[path] for pos, path in paths.items()}


def dynamic_tree_law_error(method, budget, target: PathModel, draft: PathModel, keep_child=None) -> float:
    """max |P_spec(s) - P_target(s)| over strings of length max_depth + 1, over every
    context-aware tree (each verified exactly with ``outcome_law`` on its own shape)."""
    trees, empty = dynamic_trees(budget, draft, keep_child)
    length = budget.max_depth + 1
    mass: dict[tuple, float] = defaultdict(float)
    if empty > 0:  # steps that drafted nothing sample one token from p
        row = target(())
        for y in np.nonzero(row > 0)[0]:
            mass[(int(y),)] += empty * row[y]
    for prob, tree, tokens in trees:
        toks, p, q = batch_tensors(tree, [tokens], target, draft)
        law = outcome_law(method, tree, toks, p, q).numpy()[0]
        paths = node_paths(tree, tokens)
        for e in np.nonzero(law.sum(-1) > 0)[0]:
            for y in np.nonzero(law[e] > 0)[0]:
                mass[paths[e] + (int(y),)] += prob * law[e, y]
    return _string_error(mass, target, length)
