"""The per-request tree store between the drafter and the verifier."""

import torch

from vllm_univer.integration.tree_state import DraftedTrees, TreeState


def test_tree_state_gathers_trees_drafted_with_and_without_q():
    """Trees from an all-greedy drafting step carry no q; gathered beside trees
    that have one, their rows are zero and flagged for the verifier to fill."""
    state = TreeState()
    q = torch.rand(1, 3, 5)
    state.add(DraftedTrees(["greedy"], torch.tensor([[4, 1, 2]]), None))
    state.add(DraftedTrees(["sampled"], torch.tensor([[3, 0, 1]]), q))
    tokens, got_q, found, q_missing = state.gather(["sampled", "greedy", "new"])
    assert found == [True, True, False]
    assert tokens.tolist() == [[3, 0, 1], [4, 1, 2], [-1, -1, -1]]
    assert q_missing.tolist() == [False, True, False]
    assert torch.equal(got_q[0], q[0]) and (got_q[1] == 0).all()
    tokens, got_q, _, q_missing = state.gather(["greedy"])
    assert got_q is None and q_missing is None and tokens.tolist() == [[4, 1, 2]]
