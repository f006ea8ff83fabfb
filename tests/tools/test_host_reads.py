"""``tools/host_reads.HostReadGuard``: a host read of a value computed from the
guarded tensors raises while armed, through ops, views and in-place writes;
reads of other tensors, and reads after ``disarm``, pass."""

from __future__ import annotations

import pytest
import torch

from vllm_univer.tools.host_reads import HostReadGuard, TaintedHostRead


@pytest.mark.parametrize(
    "read",
    [
        lambda t: t.tolist(),
        lambda t: t.numpy(),
        lambda t: t.sum().item(),
        lambda t: bool(t[0] > 0),
        lambda t: int(t[1]),
        lambda t: torch.arange(3)[t > 0],  # indexing by a mask: the result's size is read
    ],
)
def test_a_read_of_a_derived_value_raises(read):
    sampled = torch.tensor([3, 4, -1])
    with HostReadGuard([sampled]):
        derived = (sampled >= 0).sum().unsqueeze(0) + torch.arange(3)
        with pytest.raises(TaintedHostRead):
            read(derived)


def test_taint_follows_in_place_writes_and_views():
    sampled = torch.tensor([3, 4, -1])
    buffer = torch.zeros(2, 3, dtype=torch.long)  # a persistent buffer written with derived values
    other = torch.ones(4)
    with HostReadGuard([sampled]) as guard:
        buffer[0, :2] = sampled[:2] * 2
        assert guard.is_tainted(buffer[1])  # a view of a written buffer: the same memory
        with pytest.raises(TaintedHostRead):
            buffer[1].tolist()
        torch.index_select(other, 0, torch.tensor([0, 1])).tolist()  # untainted: fine
        assert other.numpy().sum() == 4
        guard.disarm()
        assert buffer[0].tolist() == [6, 8, 0] and guard.reads == 1


def test_python_reads_are_restored_after_the_guard():
    original = torch.Tensor.tolist
    with HostReadGuard([torch.tensor([1])]):
        assert torch.Tensor.tolist is not original
    assert torch.Tensor.tolist is original
    assert torch.tensor([1, 2]).tolist() == [1, 2]


def test_reads_inside_an_exempt_function_are_counted_not_raised():
    sampled = torch.tensor([3, 4, -1])

    def known_read(t):
        return bool((t > 0).any())

    with HostReadGuard([sampled], exempt=("known_read",)) as guard:
        assert known_read(sampled + 1)
        with pytest.raises(TaintedHostRead):
            bool((sampled > 0).any())
    assert guard.exempt_reads == 1
