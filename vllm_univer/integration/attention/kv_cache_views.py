"""Views of vLLM's paged KV cache in the layout the tree kernels read:
keys and values each ``[num_blocks, block_size, num_kv_heads, head_size]``,
indexed ``cache[blocks, offsets]`` for reads and writes that go through.

vLLM 0.32 keeps one tensor per layer, logically
``[num_blocks, num_kv_heads, block_size, 2 * head_size]``. The CUDA backends
(FlashAttention, Triton) read it as ``kv_cache.transpose(1, 2).split(head_size, -1)``
(``standard_kv_views``). The CPU attention keeps the same tensor viewed as
``[num_blocks, num_kv_heads, 2 * block_size, head_size]``: per (block, head)
a key half then a value half of ``block_size * head_size`` elements each, laid
out for its attention ISA (element (token t, dim d), offsets within the half):

* ``vec`` (x86 without AMX, or float32 / float16): keys transposed,
  ``d * block_size + t``; values row-major, ``t * head_size + d``. Both are
  plain strided views.
* ``amx`` (x86 with AMX, bfloat16, block size a multiple of 32): the operands of
  AMX's bf16 tile products, packed in pairs ("VNNI") along each product's
  reduction axis. Keys (Q K^T reduces over d) in tiles of 16 tokens:
  ``(t // 16) * 16 * head_size + (d // 2) * 32 + (t % 16) * 2 + d % 2``; values
  (P V reduces over t) in tiles of 16 dims:
  ``(d // 16) * 16 * block_size + (t // 2) * 32 + (d % 16) * 2 + t % 2``.
  Each is a strided view with the token axis and the head-dim axis split in
  two (``TiledPagedCache``). The layout was read off vLLM's own
  ``cpu_attn_reshape_and_cache`` (``tests/integration/attention/test_kv_cache_views.py`` writes
  through it and reads back through these views).
"""

from __future__ import annotations

import torch

SUPPORTED_ISAS = ("vec", "amx")


def check_cpu_isa(isa: str | None) -> None:
    """Refuse a CPU attention ISA whose KV layout tree attention does not read."""
    if isa not in SUPPORTED_ISAS:
        raise NotImplementedError(
            f"tree attention on CPU reads the KV cache of the {SUPPORTED_ISAS} attention ISAs; "
            f"this machine's CPU attention uses {isa!r} (vec16: head sizes not a multiple of 32; "
            "neon / vsx / vxe / rvv: non-x86 CPUs). Use a GPU."
        )


def _check_cpu_cache(kv_cache: torch.Tensor, isa: str | None) -> None:
    """The layouts below are read off a contiguous cache of a supported ISA."""
    check_cpu_isa(isa)
    if not kv_cache.is_contiguous():
        raise ValueError("expected a contiguous CPU KV cache tensor")


class TiledPagedCache:
    """A paged K or V cache stored with its token and head-dim axes each split in
    two, read and written as ``[num_blocks, block_size, H, Dh]`` through
    ``cache[blocks, offsets]`` (what ``gather_paged`` and ``move_paged_kv`` use)
    and read whole blocks through ``cache[blocks]`` (``gather_context``).

    tiles: a strided view [num_blocks, block_size // inner, inner, H, Dh // lanes, lanes].
    """

    def __init__(self, tiles: torch.Tensor):
        self.tiles = tiles
        num_blocks, outer, self.inner, heads, d_outer, lanes = tiles.shape
        self.shape = torch.Size((num_blocks, outer * self.inner, heads, d_outer * lanes))
        self.device, self.dtype = tiles.device, tiles.dtype

    def _split(self, index):
        blocks, offsets = index
        return blocks, offsets // self.inner, offsets % self.inner

    def __getitem__(self, index) -> torch.Tensor:
        """cache[blocks, offsets] -> [..., H, Dh]; cache[blocks] -> [..., block_size, H, Dh] (whole blocks)."""
        if not isinstance(index, tuple):
            return self.tiles[index].flatten(-2).flatten(-4, -3)
        return self.tiles[self._split(index)].flatten(-2)

    def __setitem__(self, index, value: torch.Tensor) -> None:
        self.tiles[self._split(index)] = value.unflatten(-1, self.tiles.shape[-2:])


def cpu_kv_views(kv_cache: torch.Tensor, isa: str):
    """kv_cache [num_blocks, H, block_size, 2*Dh] -> (keys, values), each read and
    written as [num_blocks, block_size, H, Dh] (a strided view, or a
    ``TiledPagedCache`` over one for ``amx``) of the same storage."""
    _check_cpu_cache(kv_cache, isa)
    num_blocks, heads, block_size, two_dh = kv_cache.shape
    head_size = two_dh // 2
    s_block, s_head = kv_cache.stride(0), kv_cache.stride(1)
    value_offset = kv_cache.storage_offset() + block_size * head_size
    if isa == "amx":
        keys = kv_cache.as_strided(
            (num_blocks, block_size // 16, 16, heads, head_size // 2, 2), (s_block, 16 * head_size, 2, s_head, 32, 1)
        )
        values = kv_cache.as_strided(
            (num_blocks, block_size // 2, 2, heads, head_size // 16, 16),
            (s_block, 32, 1, s_head, 16 * block_size, 2),
            storage_offset=value_offset,
        )
        return TiledPagedCache(keys), TiledPagedCache(values)
    # Key half of (block, head): bs * Dh elements, transposed: [Dh, bs].
    keys = kv_cache.as_strided((num_blocks, block_size, heads, head_size), (s_block, 1, s_head, block_size))
    # Value half: the next bs * Dh elements, row-major [bs, Dh].
    values = kv_cache.as_strided(
        (num_blocks, block_size, heads, head_size), (s_block, head_size, s_head, 1), storage_offset=value_offset
    )
    return keys, values


def _head_major_views(kv_cache: torch.Tensor, isa: str) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_cache [num_blocks, H, block_size, 2*Dh] (one layer of vLLM's CPU cache) ->
    (keys, values), strided views [H, num_blocks, ...] whose trailing axes, read in
    order, run over (token, head dim) of one block: [H, num_blocks, block_size, Dh]
    once flattened (and, for amx keys, viewed back from int32 to the cache dtype).
    The axis orders are those of the layouts in the module docstring."""
    num_blocks, heads, block_size, two_dh = kv_cache.shape
    dh = two_dh // 2
    halves = kv_cache.view(num_blocks, heads, 2, block_size * dh)
    keys, values = halves[:, :, 0], halves[:, :, 1]
    if isa == "amx":
        # keys (t//16, d//2, t%16, d%2): the (d, d+1) pairs of one token are adjacent;
        # moved as int32 words, the copy into token order moves half as many elements.
        keys = keys.view(torch.int32).unflatten(-1, (block_size // 16, dh // 2, 16)).permute(1, 0, 2, 4, 3)
        # values (d//16, t//2, d%16, t%2)
        values = values.unflatten(-1, (dh // 16, block_size // 2, 16, 2)).permute(1, 0, 3, 5, 2, 4)
    else:
        keys = keys.unflatten(-1, (dh, block_size)).permute(1, 0, 3, 2)  # (d, t)
        values = values.unflatten(-1, (block_size, dh)).transpose(0, 1)  # (t, d)
    return keys, values


def gather_cpu_blocks(
    kv_cache: torch.Tensor, isa: str, blocks: torch.Tensor, workspace: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole blocks of one layer of vLLM's CPU cache, in token order, for attention.

    kv_cache [num_blocks, H, block_size, 2*Dh]; blocks [B, n] block ids (each
    request's first n blocks) -> (keys, values), each [B, n * block_size, H, Dh],
    views of head-major copies ([H, B, n * block_size, Dh] contiguous, what
    ``masked_attention`` reads in place).

    The blocks are copied whole (``index_select`` of contiguous runs, a quarter of
    the time of advanced indexing), then each half is put in token order from the
    ISA's layout. (Not ``index_select`` on the reordered views: on a strided source
    it first copies the whole layer.) ``workspace``: a dict kept by the caller
    across calls of one shape (the layers of one forward); the copies are made into
    its buffers, so fresh megabytes are not allocated (and page-faulted) per layer.
    The returned tensors are valid until the next call with the same workspace.
    """
    _check_cpu_cache(kv_cache, isa)
    batch, n = blocks.shape
    heads, block_size, head_size = kv_cache.shape[1], kv_cache.shape[2], kv_cache.shape[3] // 2
    workspace = {} if workspace is None else workspace

    def buffer(name, like):
        if name not in workspace or workspace[name].shape != like.shape or workspace[name].dtype != like.dtype:
            workspace[name] = torch.empty(like.shape, dtype=like.dtype, device=like.device)
        return workspace[name]

    ids = blocks.reshape(-1).long()
    picked = buffer("blocks", kv_cache[: batch * n])
    torch.index_select(kv_cache, 0, ids, out=picked)  # [B*n, H, block_size, 2*Dh]
    return tuple(
        buffer(name, view)
        .copy_(view)
        .view(kv_cache.dtype)
        .view(heads, batch, n * block_size, head_size)
        .permute(1, 2, 0, 3)
        for name, view in zip(("keys", "values"), _head_major_views(picked, isa))
    )


def standard_kv_views(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The CUDA backends' split: [num_blocks, H, block_size, 2*Dh] -> (keys, values),
    each [num_blocks, block_size, H, Dh] (whatever the physical stride order)."""
    both = kv_cache.transpose(1, 2)
    return both[..., :head_size], both[..., head_size:]  # split()'s views, in fewer host microseconds


def layer_kv_views(impl, kv_cache: torch.Tensor, isa: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) of one attention layer's cache, for the backend that owns it.
    ``isa``: the CPU backend's attention ISA (``layer.isa``), None elsewhere."""
    from .tree_attention_plan import backend_kind

    if backend_kind(impl) == "cpu":
        return cpu_kv_views(kv_cache, isa)
    return standard_kv_views(kv_cache, impl.head_size)
