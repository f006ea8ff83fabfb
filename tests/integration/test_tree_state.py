"""The per-request tree store between the drafter and the verifier."""

import pytest
import torch

from vllm_univer.core.tree import TreeSpec
from vllm_univer.integration.tree_state import DraftedTrees, TreeState

pytestmark = pytest.mark.quick

TREE_1X2 = TreeSpec.parse("1x2")


def test_tree_state_gathers_trees_drafted_with_and_without_q():
    """Trees from an all-greedy drafting step carry no q; gathered beside trees
    that have one, their rows are zero and flagged for the verifier to fill."""
    state = TreeState()
    q = torch.rand(1, 3, 5)
    state.add(DraftedTrees(["greedy"], torch.tensor([[4, 1, 2]]), None, TREE_1X2))
    state.add(DraftedTrees(["sampled"], torch.tensor([[3, 0, 1]]), q, TREE_1X2))
    tokens, got_q, found, q_missing = state.gather(["sampled", "greedy", "new"])
    assert found == [True, True, False]
    assert tokens.tolist() == [[3, 0, 1], [4, 1, 2], [-1, -1, -1]]
    assert q_missing.tolist() == [False, True, False]
    assert torch.equal(got_q[0], q[0]) and (got_q[1] == 0).all()
    tokens, got_q, _, q_missing = state.gather(["greedy"])
    assert got_q is None and q_missing is None and tokens.tolist() == [[4, 1, 2]]


def test_a_tree_of_another_shape_is_verified_as_no_tree():
    """tree "auto" switches shapes between steps: a request the scheduler skipped
    keeps a tree of the old shape, which the next step (new shape) must not read
    with the new shape's node ids; it verifies the root alone (lossless)."""
    state = TreeState()
    state.add(DraftedTrees(["skipped"], torch.tensor([[5, 1, 2]]), None, TREE_1X2))
    wide = TreeSpec.parse("2x1")
    state.add(DraftedTrees(["drafted"], torch.tensor([[6, 3, 4]]), None, wide))
    assert state.latest_tree == wide
    tokens, _, found, _ = state.gather(["drafted", "skipped"], state.latest_tree)
    assert found == [True, False]
    assert tokens.tolist() == [[6, 3, 4], [-1, -1, -1]]
    tokens, _, found, _ = state.gather(["drafted", "skipped"])  # no shape asked: both, as stored
    assert found == [True, True] and tokens.tolist() == [[6, 3, 4], [5, 1, 2]]


def test_trees_drafted_to_different_depths_gather_with_zero_deeper_rows():
    """A depth cut keeps q rows down to its deepest level only (1x2 cut to depth 1:
    2 of 3 rows); gathered beside a tree drafted deeper (a request the scheduler
    skipped for a step), the missing rows are zero, as a drafted leaf level's are."""
    state = TreeState()
    deep, shallow = torch.rand(1, 3, 5), torch.rand(1, 2, 5)
    state.add(DraftedTrees(["deep"], torch.tensor([[3, 0, 1]]), deep, TREE_1X2))
    state.add(DraftedTrees(["shallow"], torch.tensor([[4, 2, -1]]), shallow, TREE_1X2))
    tokens, got_q, found, q_missing = state.gather(["shallow", "deep"], TREE_1X2)
    assert found == [True, True] and q_missing.tolist() == [False, False]
    assert got_q.shape == (2, 3, 5)
    assert torch.equal(got_q[0, :2], shallow[0]) and (got_q[0, 2] == 0).all()
    assert torch.equal(got_q[1], deep[0])


def test_a_greedy_tree_deeper_than_every_tree_with_q_gets_rows_to_its_depth():
    """tree "auto" drafted every request to depth 1 (q rows down to depth 1), then
    only the greedy ones, deeper and without q, while a sampled request the
    scheduler skipped keeps its shallow tree: the step verifies the shape cut to
    depth 2, and q must have its rows (the greedy ones flagged, filled with p)."""
    state = TreeState()
    shallow = torch.rand(1, 2, 5)
    state.add(DraftedTrees(["skipped"], torch.tensor([[3, 0, -1]]), shallow, TREE_1X2))
    state.add(DraftedTrees(["greedy"], torch.tensor([[4, 1, 2]]), None, TREE_1X2))
    tokens, got_q, found, q_missing = state.gather(["greedy", "skipped"], TREE_1X2, num_rows=3)
    assert found == [True, True] and q_missing.tolist() == [True, False]
    assert got_q.shape == (2, 3, 5)
    assert torch.equal(got_q[1, :2], shallow[0]) and (got_q[1, 2] == 0).all()
    _, got_q, _, _ = state.gather(["skipped"], TREE_1X2, num_rows=1)  # and cut to the rows asked for
    assert torch.equal(got_q, shallow[:, :1])


def test_forgotten_trees_are_not_gathered():
    """A request of the batch that gets no tree this step (cut to depth 0) drops its
    older tree: the next step verifies none for it."""
    state = TreeState()
    state.add(DraftedTrees(["plain", "other"], torch.tensor([[3, 0, 1], [4, 1, 2]]), None, TREE_1X2))
    state.forget(["plain", "absent"])
    tokens, _, found, _ = state.gather(["plain", "other"], TREE_1X2)
    assert found == [False, True] and tokens.tolist() == [[-1, -1, -1], [4, 1, 2]]


def test_parents_of_context_aware_trees_follow_their_requests():
    """tree "dynamic": each request's parents come back in the batch's order, from
    whichever drafting they were stored by; a request without a tree of these levels
    gets the root alone."""
    from vllm_univer.core.tree_batch import LevelLayout

    layout = LevelLayout((1, 2, 2), 2)
    state = TreeState()
    first = torch.tensor([[-1, 0, 0, 1, 1], [-1, 0, 0, 2, -1]])
    state.add(DraftedTrees(["a", "b"], torch.zeros(2, 5, dtype=torch.long), None, layout, first))
    state.add(DraftedTrees(["c"], torch.zeros(1, 5, dtype=torch.long), None, layout, torch.tensor([[-1, 0, 0, 1, 2]])))
    state.add(DraftedTrees(["static"], torch.zeros(1, 3, dtype=torch.long), None, TREE_1X2))
    got = state.parents_of(["c", "new", "b", "static", "a"], layout, torch.device("cpu"))
    assert got.tolist() == [[-1, 0, 0, 1, 2], [-1] * 5, [-1, 0, 0, 2, -1], [-1] * 5, [-1, 0, 0, 1, 1]]
