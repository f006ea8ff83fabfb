"""The buffers kept across engine steps: reused on CPU, never under a tree that
still needs its draft rows."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm_univer.core.tree import TreeSpec  # noqa: E402
from vllm_univer.integration.step_buffer import StepBuffer  # noqa: E402
from vllm_univer.integration.tree_drafter import TreeDrafter  # noqa: E402
from vllm_univer.integration.tree_state import DraftedTrees, TreeState  # noqa: E402


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_buffer_is_reused_and_grown():
    buffer = StepBuffer(torch.device("cpu"))
    a = buffer.get((2, 3, 4))
    assert a.shape == (2, 3, 4) and buffer.holds(a)
    b = buffer.get((1, 3, 4))  # smaller: the same memory
    assert storage(b) == storage(a)
    c = buffer.get((4, 3, 4))  # larger: a new buffer; the old views stay valid
    assert storage(c) != storage(a) and buffer.holds(c) and not buffer.holds(a)
    a.fill_(1.0)
    assert (a == 1.0).all()
    per_call = StepBuffer(torch.device("cpu"), keep=False)  # the CUDA policy: a new tensor per call
    x = per_call.get((2, 2))
    assert x.shape == (2, 2) and not per_call.holds(x)
    capped = StepBuffer(torch.device("cpu"), max_kept_bytes=64)  # 16 float32 elements
    kept, too_big = capped.get((4, 4)), capped.get((4, 5))
    assert capped.holds(kept) and not capped.holds(too_big) and too_big.shape == (4, 5)


def drafter_with(state: TreeState) -> TreeDrafter:
    drafter = object.__new__(TreeDrafter)  # only the q-buffer bookkeeping is exercised
    drafter.state = state
    drafter.q_rows = StepBuffer(torch.device("cpu"))
    return drafter


def test_q_rows_of_a_tree_that_survives_the_step_are_not_overwritten():
    state = TreeState()
    drafter = drafter_with(state)
    shape = (2, 3, 5)
    first = drafter._q_buffer(shape, {"a", "b"})
    first.copy_(torch.rand(shape))
    state.add(DraftedTrees(["a", "b"], torch.zeros(2, 3, dtype=torch.long), first, TreeSpec.parse("1x2")))
    kept = first[1].clone()

    # Both trees are re-drafted this step: their rows may be overwritten.
    again = drafter._q_buffer(shape, {"a", "b"})
    assert storage(again) == storage(first)

    # "b" was skipped by the scheduler: its tree (rows in the buffer) must survive.
    fresh = drafter._q_buffer((1, 3, 5), {"a"})
    assert storage(fresh) != storage(first)
    fresh.fill_(-1.0)
    assert torch.equal(first[1], kept)
