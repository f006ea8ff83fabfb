"""Context-aware trees (``core.dynamic_tree``): lossless by the exact law of every
tree the rule can grow (float64, every draw enumerated on a tiny vocabulary, each
tree verified on its own shape), and the code that runs draws exactly those trees
(seeded chi-square). A rule that drops a drawn child for its own value is caught."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_univer.core.dynamic_tree import DynamicTreeBudget, draw_children, plan_children
from vllm_univer.tools.goodness_of_fit import chi_square_pvalue
from vllm_univer.tools.law_oracle import PathModel, dynamic_tree_law_error, dynamic_trees

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


def _grow_sampled(budget: DynamicTreeBudget, draft: PathModel, batch: int, generator: torch.Generator):
    """The level loop a drafter runs, over a batch: ``plan_children`` then
    ``draw_children`` per level. Returns each request's {slot path: token}."""
    vocab = draft.vocab
    frontier = [[((), (), 1.0)] for _ in range(batch)]
    nodes: list[dict] = [{} for _ in range(batch)]
    left = torch.full((batch,), budget.max_nodes, dtype=torch.long)
    for _ in range(budget.max_depth):
        width = max(len(f) for f in frontier)
        if width == 0:
            break
        q = torch.zeros(batch, width, vocab, dtype=torch.float64)
        scores = torch.zeros(batch, width, dtype=torch.float64)
        for b, front in enumerate(frontier):
            for i, (_, tokens, score) in enumerate(front):
                q[b, i] = torch.from_numpy(draft(tokens))
                scores[b, i] = score
        k = plan_children(scores, q, budget, left)
        kids = draw_children(q, k, budget.max_children, generator)
        left = left - k.sum(-1)
        k_list, kids_list, score_list = k.tolist(), kids.tolist(), scores.tolist()
        for b, front in enumerate(frontier):
            expanded = sorted((i for i in range(len(front)) if k_list[b][i] > 0), key=lambda i: (-score_list[b][i], i))
            nxt = []
            for i in expanded:
                spath, tpath, score = front[i]
                for slot in range(k_list[b][i]):
                    tok = kids_list[b][i][slot]
                    nodes[b][spath + (slot,)] = tok
                    if tok >= 0:
                        nxt.append((spath + (slot,), tpath + (tok,), score * draft(tpath)[tok]))
            frontier[b] = nxt
    return nodes


@pytest.mark.parametrize("budget,vocab,seed,independent", [(BUDGETS[0], 3, 1, False), (VARYING, 4, 0, True)])
def test_the_drafting_code_draws_the_enumerated_trees(budget, vocab, seed, independent):
    _, draft = _pair(vocab, seed, independent)
    trees, empty = dynamic_trees(budget, draft)
    assert empty == 0
    index = {tuple(sorted(zip(tree.paths[1:], tokens[1:]))): j for j, (_, tree, tokens) in enumerate(trees)}
    counts = np.zeros(len(trees))
    for nodes in _grow_sampled(budget, draft, batch=8000, generator=torch.Generator().manual_seed(seed)):
        key = tuple(sorted(nodes.items()))
        assert key in index, f"a tree the rule cannot grow: {key}"
        counts[index[key]] += 1
    assert chi_square_pvalue(counts, [pr for pr, _, _ in trees]) > 1e-3
