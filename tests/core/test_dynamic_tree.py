"""Context-aware trees (``core.dynamic_tree``): lossless by the exact law of every
tree the rule can grow (float64, every draw enumerated on a tiny vocabulary, each
tree verified on its own shape), and the code that runs draws exactly those trees
(seeded chi-square). A rule that drops a drawn child for its own value is caught."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_univer.core.api import outcome_law
from vllm_univer.core.dynamic_tree import DynamicTreeBudget, grow_trees, level_sizes, plan_children
from vllm_univer.tools.goodness_of_fit import chi_square_pvalue
from vllm_univer.tools.law_oracle import PathModel, dynamic_tree_law_error, dynamic_trees, tree_of_row

pytestmark = pytest.mark.quick

BUDGETS = [
    DynamicTreeBudget(max_nodes=4, max_depth=2, expand=2, max_children=2),
    DynamicTreeBudget(max_nodes=5, max_depth=3, expand=1, max_children=2),
    DynamicTreeBudget(max_nodes=6, max_depth=2, expand=2, max_children=3),
    DynamicTreeBudget(max_nodes=3, max_depth=3, expand=2, max_children=2),  # the budget binds before depth
]
# Depth 3 with a frontier wider than `expand`: which nodes grow depends on the drawn
# tokens' own values and their cousins' (4 shapes on this pair, 276 trees).
VARYING = DynamicTreeBudget(max_nodes=8, max_depth=3, expand=2, max_children=2)


def _pair(vocab: int, seed: int, independent: bool = False):
    """(target, draft): by default a draft that resembles the target, with zeros and
    ties; ``independent``: unrelated smooth laws, whose trees vary most in shape."""
    if independent:
        return PathModel(vocab, seed, zeros=False), PathModel(vocab, seed + 100, zeros=False)
    target = PathModel(vocab, seed)
    return target, PathModel(vocab, seed + 100, base=target)


CASES = [(budget, 3, seed, False) for budget in BUDGETS for seed in (0, 1)] + [
    (VARYING, 4, 0, True),
    (VARYING, 4, 7, True),
    (VARYING, 3, 0, False),
]


@pytest.mark.parametrize(
    "budget,vocab,seed,independent",
    CASES,
    ids=lambda c: (
        f"n{c.max_nodes}d{c.max_depth}e{c.expand}m{c.max_children}" if isinstance(c, DynamicTreeBudget) else str(c)
    ),
)
@pytest.mark.parametrize("method", ["univer", "greedy", "target_only"])
def test_every_tree_the_rule_grows_keeps_the_target_law(budget, vocab, seed, independent, method):
    target, draft = _pair(vocab, seed, independent)
    assert dynamic_tree_law_error(method, budget, target, draft) <= 1e-12


@pytest.mark.parametrize("seed", [0, 7])
def test_shapes_follow_the_draws(seed):
    # The law test above covers trees whose shape depends on the draws: the same
    # budget grows differently shaped trees from different drawn tokens.
    target, draft = _pair(4, seed, independent=True)
    trees, empty = dynamic_trees(VARYING, draft)
    assert len({tree.paths for _, tree, _ in trees}) >= 3
    assert empty == 0 and abs(sum(pr for pr, _, _ in trees) - 1.0) < 1e-12


def test_dropping_a_child_for_its_own_value_is_caught():
    # EAGLE-2's final re-rank keeps or drops a sampled child by its own score: the
    # verifier then sees a child whose law is no longer q off the top tokens.
    target, draft = _pair(vocab=3, seed=0)

    def rerank(q_row, slot, token):
        return slot > 0 or q_row[token] >= 0.25

    assert dynamic_tree_law_error("univer", BUDGETS[0], target, draft, keep_child=rerank) > 1e-4


def test_plan_respects_expand_width_and_budget():
    scores = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.1, 0.1]], dtype=torch.float64)
    q = torch.softmax(torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64), -1)
    budget = DynamicTreeBudget(max_nodes=64, max_depth=3, expand=2, max_children=3)
    k = plan_children(scores, q, budget, torch.tensor([64, 4]))
    assert k[0].tolist() == [3, 3, 0, 0]  # the two best nodes, expand * m slots
    assert k[1].sum() == 4 and k[1, 2:].sum() == 0  # the node budget binds; ties go to the lower index
    assert (plan_children(scores, q, budget, torch.tensor([0, 0])) == 0).all()


def test_bad_budgets_say_why():
    with pytest.raises(ValueError, match="expand must be >= 1"):
        DynamicTreeBudget(expand=0)
    with pytest.raises(ValueError, match="max_nodes 500"):
        DynamicTreeBudget(max_nodes=500)


def _path_rows(draft: PathModel):
    """draft_rows for ``grow_trees`` from a PathModel: q of each position's token path
    (paths [B, F, d], -1 padded; a position without a node reads its parent's row,
    which nothing draws from)."""

    def rows(paths: torch.Tensor) -> torch.Tensor:
        batch, width, _ = paths.shape
        out = torch.zeros(batch, width, draft.vocab, dtype=torch.float64)
        cache: dict[tuple, torch.Tensor] = {}
        for b, row in enumerate(paths.tolist()):
            for f, path in enumerate(row):
                key = tuple(path)
                while key and key[-1] == -1:  # padding past the position's depth, or no node there
                    key = key[:-1]
                if -1 not in key:
                    if key not in cache:
                        cache[key] = torch.from_numpy(draft(key))
                    out[b, f] = cache[key]
        return out

    return rows


def _grown_nodes(grown) -> list[dict]:
    """Each request's {slot path: token} from the grown batch (positions that hold a node)."""
    trees, tokens = grown.trees, grown.tokens.tolist()
    out = []
    for b, parent_row in enumerate(trees.parent.tolist()):
        tree, node_of = tree_of_row(parent_row)
        out.append({tree.paths[node]: tokens[b][pos] for pos, node in node_of.items() if pos > 0})
    return out


@pytest.mark.parametrize("budget,vocab,seed,independent", [(BUDGETS[0], 3, 1, False), (VARYING, 4, 0, True)])
def test_the_drafting_code_draws_the_enumerated_trees(budget, vocab, seed, independent):
    _, draft = _pair(vocab, seed, independent)
    trees, empty = dynamic_trees(budget, draft)
    assert empty == 0
    index = {tuple(sorted(zip(tree.paths[1:], tokens[1:]))): j for j, (_, tree, tokens) in enumerate(trees)}
    counts = np.zeros(len(trees))
    grown = grow_trees(budget, _path_rows(draft), batch=8000, generator=torch.Generator().manual_seed(seed))
    for nodes in _grown_nodes(grown):
        key = tuple(sorted(nodes.items()))
        assert key in index, f"a tree the rule cannot grow: {key}"
        counts[index[key]] += 1
    assert chi_square_pvalue(counts, [pr for pr, _, _ in trees]) > 1e-3


@pytest.mark.parametrize("method", ["univer", "greedy", "target_only"])
def test_grown_batches_verify_as_their_own_trees(method):
    """A grown batch (per-request shapes in one layout) verifies, row by row, exactly
    as each tree on its own shape: so the exact law above is the law of the batch."""
    target, draft = _pair(4, 0, independent=True)
    grown = grow_trees(VARYING, _path_rows(draft), batch=24, generator=torch.Generator().manual_seed(3))
    trees, tokens, q = grown.trees, grown.tokens, grown.draft_probs
    p = _path_rows(target)(trees.token_paths(tokens))
    law = outcome_law(method, trees, tokens, p, q)
    shapes = set()
    for b in range(24):
        tree, node_of = tree_of_row(trees.parent[b].tolist())
        shapes.add(tree.paths)
        pos = torch.tensor([pos for pos, _ in sorted(node_of.items(), key=lambda kv: kv[1])])
        own = outcome_law(method, tree, tokens[b : b + 1, pos], p[b : b + 1, pos], q[b : b + 1, pos])
        assert (law[b, pos] - own[0]).abs().max() < 1e-12
    assert len(shapes) >= 2


def test_level_sizes_follow_the_budget():
    assert level_sizes(DynamicTreeBudget(32, 6, 4, 4)) == (1, 4, 16, 12)
    assert level_sizes(DynamicTreeBudget(8, 3, 2, 2)) == (1, 2, 4, 2)
    assert level_sizes(DynamicTreeBudget(5, 3, 1, 2)) == (1, 2, 2, 1)
    assert level_sizes(DynamicTreeBudget(64, 2, 8, 4)) == (1, 4, 16)
