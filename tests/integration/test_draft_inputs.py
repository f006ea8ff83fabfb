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
from vllm_univer.integration.draft_inputs import DraftRoots, build_draft_step_inputs, new_token_counts  # noqa: E402
from vllm_univer.integration.host_to_device import upload  # noqa: E402
from vllm_univer.integration.tree_drafter import _Shape  # noqa: E402

BLOCK_SIZE = 4
WIDTH = 4  # the sampled rows' width (a tree of depth 3)


class _DeviceOnly(torch.Tensor):
    """A tensor whose values the host must not read (a device tensor the step has
    not finished): every tensor computed from it is one too."""

    READS = {"tolist", "item", "numpy", "__bool__", "__int__", "__index__", "__float__", "__array__", "__repr__"}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in cls.READS:
            raise AssertionError(f"the host read a value of this step's sampled tokens ({func.__name__})")
        return super().__torch_function__(func, types, args, kwargs or {})


def _values(t: torch.Tensor) -> list:
    return t.as_subclass(torch.Tensor).tolist()


def _requests():
    """Four requests: (history of committed tokens, start, this step's new tokens
    (-1 padded), bound on them): a tree verified with two nodes accepted, one
    verified with none, a whole prompt (no tree), a catch-up of two tokens."""
    rng = np.random.default_rng(0)
    history = [rng.integers(0, 1000, n).tolist() for n in (10, 7, 13, 3)]
    start = [9, 6, 0, 1]
    new = [[501, 502, 503, -1], [504, -1, -1, -1], [505, -1, -1, -1], [506, -1, -1, -1]]
    max_new = [4, 3, 1, 1]
    return history, start, new, max_new


def _step(tree: TreeSpec, depth: int, device="cpu", level_reqs=None, poisoned=False):
    history, start, new, max_new = _requests()
    committed = np.array([len(h) for h in history], dtype=np.int64)
    start = np.array(start, dtype=np.int64)
    rng = np.random.default_rng(1)
    block_rows = torch.from_numpy(rng.permutation(100)[:80].reshape(4, 20).astype(np.int32))
    spans = _Shape(tree, torch.device("cpu")).level_span
    new_tokens = torch.tensor(new, device=device)
    if poisoned:
        new_tokens = new_tokens.as_subclass(_DeviceOnly)
    roots = DraftRoots(
        start=start,
        committed=committed,
        max_new=np.array(max_new, dtype=np.int64),
        committed_tokens=[h[s:] for h, s in zip(history, start.tolist())],
        new_tokens=new_tokens,
        new_counts=new_token_counts(new_tokens),
    )
    step = build_draft_step_inputs(roots, spans, depth, block_rows, BLOCK_SIZE, torch.device(device), level_reqs)
    return step, roots, block_rows, spans


def _slot(block_rows, r, pos):
    return int(block_rows[r, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE


@pytest.mark.parametrize(
    "shape,depth,level_reqs",
    [
        ("2x3", 3, None),
        ("3x2", 2, None),
        ("2x3", 1, None),
        ("1x4", 4, None),
        # Requests cut shallower drop out of the deeper levels (cuts 3, 3, 2, 1 and 4, 2, 2, 1).
        ("2x3", 3, [4, 3, 2]),
        ("1x4", 4, [4, 3, 1, 1]),
    ],
)
@pytest.mark.parametrize("poisoned", [False, True])
def test_every_level_places_each_token_where_the_drafter_runs_it(shape, depth, level_reqs, poisoned):
    """Against a per-token recomputation from each request's whole text (history +
    new tokens): level 0 runs start + s .. root (s = new tokens - 1), every level's
    tokens at their positions and slots; the host reads none of the step's tokens."""
    tree = TreeSpec.parse(shape)
    step, roots, block_rows, spans = _step(tree, depth, level_reqs=level_reqs, poisoned=poisoned)
    history, start, new, max_new = _requests()
    text = [h + [t for t in row if t >= 0] for h, row in zip(history, new)]
    shift = [len([t for t in row if t >= 0]) - 1 for row in new]
    root_pos = [len(h) + s for h, s in zip(history, shift)]
    assert shift == [2, 0, 0, 0] and root_pos == [12, 7, 13, 3]
    assert len(step.levels) == depth
    for level in step.levels:  # what vLLM's attention metadata and the draft model take
        assert (level.positions.dtype, level.slot_mapping.dtype) == (torch.int64, torch.int64)
        assert (level.seq_lens.dtype, level.query_start_loc.dtype) == (torch.int32, torch.int32)
    assert _values(step.context_lens) == root_pos
    assert _values(step.root_tokens) == [t[-1] for t in text]
    assert torch.equal(step.block_table, block_rows)

    level = step.levels[0]  # every missing token, causally, up to the root
    want = [(r, pos) for r in range(4) for pos in range(start[r] + shift[r], root_pos[r] + 1)]
    assert _values(level.token_ids) == [text[r][pos] for r, pos in want]
    assert _values(level.positions) == [pos for _, pos in want]
    assert _values(level.slot_mapping) == [_slot(block_rows, r, pos) for r, pos in want]
    assert _values(step.root_rows) == [2 - 1, 2 + 2 - 1, 4 + 14 - 1, 18 + 3 - 1]
    assert level.query_start_loc.tolist() == [0, 2, 4, 18, 21] == level.query_start_loc_cpu.tolist()
    assert _values(level.seq_lens) == [p + 1 for p in root_pos]
    bound = [len(h) + m - 1 for h, m in zip(history, max_new)]  # roots' positions at most
    assert level.seq_lens_cpu.tolist() == [b + 1 for b in bound]
    assert (level.max_query_len, level.max_seq_len) == (14, 14)

    for d in range(1, depth):  # nodes of depth d at RoPE position root + d, slot root + node
        first, last = spans[d]
        nodes = range(first, last + 1)
        n = 4 if level_reqs is None else level_reqs[d]  # the level's requests: the first n
        level = step.levels[d]
        assert level.token_ids is None
        assert _values(level.positions) == [root_pos[r] + d for r in range(n) for _ in nodes]
        slots = [_slot(block_rows, r, root_pos[r] + j) for r in range(n) for j in nodes]
        assert _values(level.slot_mapping) == slots
        assert level.query_start_loc.tolist() == [r * len(nodes) for r in range(n + 1)]
        assert _values(level.seq_lens) == [p + last + 1 for p in root_pos[:n]]
        assert level.seq_lens_cpu.tolist() == [b + last + 1 for b in bound[:n]]
        assert (level.max_query_len, level.max_seq_len) == (len(nodes), max(bound[:n]) + last + 1)


def test_a_shift_past_its_bound_is_clamped():
    """A bound that did not hold roots the tree at the bound, inside the request's blocks."""
    history, start, new, max_new = _requests()
    committed = np.array([len(h) for h in history], dtype=np.int64)
    new_tokens = torch.tensor(new)
    roots = DraftRoots(
        np.array(start),
        committed,
        np.ones(4, dtype=np.int64),
        [h[s:] for h, s in zip(history, start)],
        new_tokens,
        new_token_counts(new_tokens),
    )
    block_rows = torch.arange(80, dtype=torch.int32).view(4, 20)
    step = build_draft_step_inputs(
        roots,
        _Shape(TreeSpec.parse("2x2"), torch.device("cpu")).level_span,
        2,
        block_rows,
        BLOCK_SIZE,
        torch.device("cpu"),
    )
    assert step.context_lens.tolist() == committed.tolist()


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


FUSED_CHECK = """
import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from vllm_univer.core.tree import TreeSpec
from vllm_univer.integration import draft_inputs
from vllm_univer.integration.draft_inputs import DraftRoots, build_draft_step_inputs, new_token_counts
from vllm_univer.integration.tree_drafter import _Shape


class Ops(TorchDispatchMode):
    # ATen ops that would launch on a GPU (views aside).
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not getattr(func, "is_view", False) and func.overloadpacket.__name__ not in ("split", "view", "slice"):
            self.count += 1
        return out


# The interpreter's own tensor work is not what a GPU would launch: hidden from the counter.
from torch.utils._python_dispatch import _disable_current_modes
from triton.runtime.interpreter import InterpretedFunction

interpreted_run, launches = InterpretedFunction.run, []


def launch(self, *args, **kwargs):
    launches.append(self.__name__)
    with _disable_current_modes():
        return interpreted_run(self, *args, **kwargs)


InterpretedFunction.run = launch
rng = np.random.default_rng(0)
block_size, blocks, width = 4, 16, 5
ops = {}
for case in range(60):
    shape = ["2x3", "1x4", "3x2", "2x1"][case % 4]
    spans = _Shape(TreeSpec.parse(shape), torch.device("cpu")).level_span
    depth = int(rng.integers(1, len(spans) + 1))
    reqs = int(rng.integers(1, 6))
    committed = rng.integers(1, 30, reqs)
    start = np.array([rng.integers(0, c + 1) for c in committed])
    max_new = rng.integers(1, width + 1, reqs)
    # new tokens per request: 0 (a row without), up to the bound, or past it (clamped)
    counts = np.array([rng.integers(0, width + 1) for _ in range(reqs)])
    new = np.full((reqs, width), -1)
    for r, n in enumerate(counts):
        new[r, :n] = rng.integers(1, 1000, n)
    history = [rng.integers(1, 1000, c) for c in committed]
    level_reqs = None
    if case % 3 == 0:  # requests cut shallower drop out of the deeper levels
        level_reqs = [reqs] + sorted(rng.integers(1, reqs + 1, depth - 1).tolist(), reverse=True)
    new_tokens = torch.from_numpy(new)
    roots = DraftRoots(start, committed, max_new, [h[s:].tolist() for h, s in zip(history, start)],
                       new_tokens, new_token_counts(new_tokens))
    table = torch.from_numpy(rng.permutation(reqs * blocks).reshape(reqs, blocks).astype(np.int32))
    steps = {}
    for fused in (False, True):
        draft_inputs.triton_reads = lambda *t, fused=fused: fused
        with Ops() as counter:
            steps[fused] = build_draft_step_inputs(
                roots, spans, depth, table, block_size, torch.device("cpu"), level_reqs
            )
        ops.setdefault(fused, []).append(counter.count)
    a, b = steps[False], steps[True]
    for x, y in [(a.root_tokens, b.root_tokens), (a.context_lens, b.context_lens), (a.root_rows, b.root_rows)]:
        assert x.dtype == y.dtype and torch.equal(x, y), (case, x, y)
    for la, lb in zip(a.levels, b.levels):
        for field in la._fields:
            x, y = getattr(la, field), getattr(lb, field)
            if isinstance(x, torch.Tensor):
                assert x.dtype == y.dtype and torch.equal(x, y), (case, field, x, y)
            else:
                assert x == y, (case, field)
print("ops per step, PyTorch path:", max(ops[False]), "fused:", max(ops[True]), "+ one launch")
assert len(launches) == 60 and max(ops[True]) <= 5, (launches, ops[True])
print("PLACEMENT OK")
"""


def test_fused_placement_equals_the_pytorch_path_in_interpreter():
    """The CUDA path (one Triton launch, ``triton_draft_inputs``) places every
    level's positions, slots, keys seen, level 0's tokens and the roots exactly
    as the PyTorch path, over random requests, shapes, cuts and shifts (none, within
    the bound, past it), in a handful of ops per step besides the launch."""
    pytest.importorskip("triton")
    from triton_interpreter import run_interpreted

    print(run_interpreted(FUSED_CHECK, "PLACEMENT OK", timeout=900)[-300:])


def test_catch_up_chunks_write_what_one_level_zero_would():
    """A catch-up run by chunks (``build_catch_up_inputs``, ``TreeDrafter._catch_up``)
    writes each committed token's key and value where one level-0 forward over the
    whole backlog would: the same positions and slots, the chunk's tokens, keys seen
    up to and including itself (causal), whatever the chunk size."""
    from vllm_univer.integration.draft_inputs import build_catch_up_inputs

    step, roots, block_rows, _ = _step(TreeSpec.parse("2x2"), 1)
    level0 = step.levels[0]
    starts = np.concatenate([[0], np.diff(level0.query_start_loc_cpu.numpy())]).cumsum()
    for r in (2, 3):  # the whole prompt, and the catch-up of two tokens (no shift: one new token each)
        begin, end = int(roots.start[r]), int(roots.committed[r])
        one_pass = slice(int(starts[r]), int(starts[r]) + end - begin)  # level 0's committed rows of r
        for chunk in (1, 2, 5):
            positions, slots, tokens = [], [], []
            for lo in range(begin, end, chunk):
                hi = min(lo + chunk, end)
                ids, level, table = build_catch_up_inputs(
                    np.array([lo]), [roots.committed_tokens[r][lo - begin : hi - begin]], block_rows[r : r + 1],
                    BLOCK_SIZE, torch.device("cpu"),
                )  # fmt: skip
                assert level.seq_lens.tolist() == [hi] and level.query_start_loc.tolist() == [0, hi - lo]
                assert level.max_query_len == hi - lo and table.tolist() == block_rows[r : r + 1].tolist()
                positions += level.positions.tolist()
                slots += level.slot_mapping.tolist()
                tokens += ids.tolist()
            assert positions == level0.positions[one_pass].tolist() == list(range(begin, end))
            assert slots == level0.slot_mapping[one_pass].tolist() == [_slot(block_rows, r, p) for p in positions]
            assert tokens == level0.token_ids[one_pass].tolist()
