"""``DynamicTreeDrafter._nodes_to_run``: a level's draft forward runs the nodes
``plan_children`` may expand, and no fewer: every node that gets a child slot
is among them, for scores with ties, zeros (no node) and levels narrower than
``expand`` (then every node runs)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm_univer.core.dynamic_tree import DynamicTreeBudget, plan_children  # noqa: E402
from vllm_univer.integration.dynamic_tree_drafter import DynamicTreeDrafter  # noqa: E402


@pytest.mark.parametrize("expand,width", [(1, 4), (2, 6), (3, 6), (3, 3), (4, 2)])
def test_the_nodes_run_are_the_nodes_that_can_get_children(expand, width):
    gen = torch.Generator().manual_seed(expand * 10 + width)
    budget = DynamicTreeBudget(max_nodes=64, max_depth=4, expand=expand, max_children=3)
    drafter = SimpleNamespace(budget=budget)
    for trial in range(50):
        batch, vocab = 5, 11
        # Scores from a few values: ties are common; 0 marks a position without a node.
        scores = torch.randint(0, 4, (batch, width), generator=gen).double() / 4
        q = torch.softmax(torch.randn(batch, width, vocab, generator=gen, dtype=torch.float64), -1)
        slots = torch.randint(0, expand * 3 + 1, (batch,), generator=gen)
        k = plan_children(scores, q, budget, slots)
        kept = DynamicTreeDrafter._nodes_to_run(drafter, scores)
        if width <= expand:
            assert kept is None
            continue
        assert kept.shape == (batch, expand)
        run = torch.zeros(batch, width, dtype=torch.bool).scatter_(1, kept, True)
        assert not (k > 0)[~run].any(), (trial, scores, k, kept)
        # The best `expand` by score, ties to the lower index: the ranking plan_children uses.
        for r in range(batch):
            order = sorted(range(width), key=lambda i: (-float(scores[r, i]), i))[:expand]
            assert kept[r].tolist() == order
