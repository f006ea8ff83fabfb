"""The drafter's per-step inputs (``integration/draft_inputs.py``): every level's
positions, cache slots and query layout equal a per-token recomputation, and the
whole step reaches the device in two non-blocking copies whatever the depth
(before, each level forward made ~6 synchronous ones: a stream sync each on CUDA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("vllm")

from vllm_univer.core.tree import TreeSpec  # noqa: E402
from vllm_univer.integration.draft_inputs import build_draft_step_inputs  # noqa: E402
from vllm_univer.integration.host_to_device import upload  # noqa: E402
from vllm_univer.integration.tree_drafter import _Shape  # noqa: E402

BLOCK_SIZE = 4


def _step(tree: TreeSpec, depth: int, device="cpu", level_reqs=None):
    rng = np.random.default_rng(0)
    root_pos = np.array([5, 12, 3], dtype=np.int64)
    start = np.array([5, 0, 1], dtype=np.int64)  # one root only, a whole prompt, a catch-up
    level0 = [rng.integers(0, 1000, r - s + 1).tolist() for s, r in zip(start, root_pos)]
    block_rows = torch.from_numpy(rng.permutation(100)[:60].reshape(3, 20).astype(np.int32))
    spans = _Shape(tree, torch.device("cpu")).level_span
    step = build_draft_step_inputs(
        level0, start, root_pos, spans, depth, block_rows, BLOCK_SIZE, torch.device(device), level_reqs
    )
    return step, level0, start, root_pos, block_rows, spans


def _slot(block_rows, r, pos):
    return int(block_rows[r, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE


@pytest.mark.parametrize(
    "shape,depth,level_reqs",
    [
        ("2x3", 3, None),
        ("3x2", 2, None),
        ("2x3", 1, None),
        ("1x4", 4, None),
        # Requests cut shallower drop out of the deeper levels (cuts 3, 3, 1 and 4, 2, 2, 1).
        ("2x3", 3, [3, 2, 2]),
        ("1x4", 4, [3, 3, 1, 1]),
    ],
)
def test_every_level_places_each_token_where_the_drafter_runs_it(shape, depth, level_reqs):
    tree = TreeSpec.parse(shape)
    step, level0, start, root_pos, block_rows, spans = _step(tree, depth, level_reqs=level_reqs)
    assert len(step.levels) == depth
    assert step.context_lens.tolist() == root_pos.tolist()
    assert step.root_tokens.tolist() == [chunk[-1] for chunk in level0]
    assert torch.equal(step.block_table, block_rows)

    level = step.levels[0]  # every missing token, causally, up to the root
    want = [
        (r, pos, tok) for r, chunk in enumerate(level0) for pos, tok in zip(range(start[r], root_pos[r] + 1), chunk)
    ]
    assert level.token_ids.tolist() == [tok for _, _, tok in want]
    assert level.positions.tolist() == [pos for _, pos, _ in want]
    assert level.slot_mapping.tolist() == [_slot(block_rows, r, pos) for r, pos, _ in want]
    assert level.query_start_loc.tolist() == [0, 1, 14, 17] == level.query_start_loc_cpu.tolist()
    assert level.seq_lens.tolist() == (root_pos + 1).tolist() == level.seq_lens_cpu.tolist()
    assert (level.max_query_len, level.max_seq_len) == (13, 13)

    for d in range(1, depth):  # nodes of depth d at RoPE position root + d, slot root + node
        first, last = spans[d]
        nodes = range(first, last + 1)
        n = 3 if level_reqs is None else level_reqs[d]  # the level's requests: the first n
        level = step.levels[d]
        assert level.token_ids is None
        assert level.positions.tolist() == [int(root_pos[r]) + d for r in range(n) for _ in nodes]
        slots = [_slot(block_rows, r, int(root_pos[r]) + j) for r in range(n) for j in nodes]
        assert level.slot_mapping.tolist() == slots
        assert level.query_start_loc.tolist() == [r * len(nodes) for r in range(n + 1)]
        assert level.seq_lens.tolist() == (root_pos[:n] + last + 1).tolist() == level.seq_lens_cpu.tolist()
        assert (level.max_query_len, level.max_seq_len) == (len(nodes), int(root_pos[:n].max()) + last + 1)


class _Transfers(TorchDispatchMode):
    """Copies from the host to another device, and whether each was non-blocking."""

    def __init__(self):
        super().__init__()
        self.non_blocking = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.aten._to_copy.default and args[0].device.type == "cpu" and out.device.type != "cpu":
            self.non_blocking.append(bool(kwargs.get("non_blocking", False)))
        return out


@pytest.mark.parametrize("depth", [1, 2, 3, 5])
def test_a_step_reaches_the_device_in_two_nonblocking_copies(depth):
    with _Transfers() as transfers:
        step, *_ = _step(TreeSpec.parse("2x5"), depth, device="meta")
    assert transfers.non_blocking == [True, True]
    assert len(step.levels) == depth and step.levels[-1].slot_mapping.device.type == "meta"


def test_upload_copies_without_blocking_and_converts():
    host = np.arange(6, dtype=np.int64)
    with _Transfers() as transfers:
        moved = upload(host, torch.device("meta"), torch.int32)
    assert transfers.non_blocking == [True] and moved.dtype == torch.int32 and moved.shape == (6,)
    assert upload(torch.tensor([True, False]), torch.device("cpu")).tolist() == [True, False]
    assert upload(host, torch.device("cpu"), torch.float64).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
