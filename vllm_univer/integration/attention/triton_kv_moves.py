"""The accepted paths' keys/values moved in every layer's cache in one launch
(one per cache shape: the target's layers, the draft's).

``kv_compaction.move_paged_kv`` moves them with one gather and one scatter per
cache: two launches per K and per V of every layer (112 for a 28-layer model),
after the accepted paths were read on the host to list the moves. Here one
program per (request, cache) walks its request's path on the device and copies
each accepted node's slot row to its place; the caches are reached through a
table of their base addresses, as vLLM's own ``copy_blocks`` kernel does.

Order within a request: the move of depth j writes position L + j and reads
L + a_j with a_j >= j (breadth-first numbering), so walking j = 1, 2, ... no
move reads a position an earlier one wrote, and each reads its source before any
later one overwrites it (the same thread owns the same element of every row).
Requests own distinct blocks, so programs never touch each other's slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...core.kernels.checks import expect

_ELEMENT = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}  # rows are copied bit for bit
_TABLES: dict[tuple, torch.Tensor] = {}  # base addresses per set of caches (allocated once by vLLM)


def fused_kv_moves_apply(caches: list[torch.Tensor]) -> bool:
    """The kernel can move these caches: on CUDA, each a [blocks, block_size, H, Dh]
    view with Dh contiguous and a 1, 2, 4 or 8-byte element."""
    return all(c.is_cuda and c.dim() == 4 and c.stride(-1) == 1 and c.element_size() in _ELEMENT for c in caches)


def move_accepted_kv(
    caches: list[torch.Tensor], block_table: torch.Tensor, context_lens: torch.Tensor, path_nodes: torch.Tensor
) -> None:
    """Move each accepted path's keys/values to consecutive slots, in every cache.

    caches: views [num_blocks, block_size, H, Dh] (every layer's K and V; the
    target's and the draft's may differ in shape: one launch per distinct shape,
    strides and element size); block_table: int [B, max_blocks]; context_lens: [B]
    (L per request, device); path_nodes: LongTensor [B, D] (the node at depth
    j+1 of the accepted path, -1 past its end). Node a_j's entry moves from
    position L + a_j to L + j. No host sync.
    """
    if path_nodes.dim() != 2:
        raise ValueError(f"path_nodes: expected shape [B, D], got {list(path_nodes.shape)}")
    batch, depth = path_nodes.shape
    expect("path_nodes", path_nodes, (batch, depth), torch.int64)
    expect("context_lens", context_lens, (batch,), device=path_nodes.device)
    expect("block_table", block_table, (batch, None), (torch.int32, torch.int64), device=path_nodes.device)
    if batch == 0 or depth == 0 or not caches:
        return
    path_nodes = path_nodes.contiguous()
    groups: dict[tuple, list[torch.Tensor]] = {}
    for cache in caches:
        groups.setdefault((tuple(cache.shape), cache.stride(), cache.element_size()), []).append(cache)
    for group in groups.values():
        first = group[0]
        _, block_size, heads, head_dim = first.shape
        key = tuple(c.data_ptr() for c in group)
        table = _TABLES.get(key)
        if table is None:
            table = torch.tensor(key, dtype=torch.int64, device=first.device)
            _TABLES[key] = table
        _move_rows[(batch, len(group))](
            table_ptr=table,  # [num_caches] int64: each cache's base address (every cache of the group alike)
            path_ptr=path_nodes,  # [B, D] int64: accepted node ids per depth, -1 past the path
            context_ptr=context_lens,  # [B] int64: L, the root's position
            block_table_ptr=block_table,  # [B, max_blocks] int32 block table rows
            path_stride=path_nodes.stride(0),  # path row stride
            block_table_stride=block_table.stride(0),  # block table row stride
            block_stride=first.stride(0),  # elements per cache block
            slot_stride=first.stride(1),  # elements per slot in a block
            head_stride=first.stride(2),  # elements per head in a slot
            heads=heads,  # KV heads
            head_dim=head_dim,  # Dh
            ELEMENT=_ELEMENT[first.element_size()],
            DEPTH=depth,
            BLOCK_SIZE=block_size,
            HEADS_BLOCK=triton.next_power_of_2(heads),
            DIM_BLOCK=triton.next_power_of_2(head_dim),
        )


@triton.jit
def _move_rows(
    table_ptr,  # [num_caches] int64: each cache's base address (every cache of the group alike)
    path_ptr,  # [B, D] int64: accepted node ids per depth, -1 past the path
    context_ptr,  # [B] int64: L, the root's position
    block_table_ptr,  # [B, max_blocks] int32 block table rows
    path_stride,  # path row stride
    block_table_stride,  # block table row stride
    block_stride,  # elements per cache block
    slot_stride,  # elements per slot in a block
    head_stride,  # elements per head in a slot
    heads,  # KV heads
    head_dim,  # Dh
    ELEMENT: tl.constexpr,
    DEPTH: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS_BLOCK: tl.constexpr,
    DIM_BLOCK: tl.constexpr,
):
    request = tl.program_id(0)
    cache = tl.load(table_ptr + tl.program_id(1)).to(tl.pointer_type(ELEMENT))
    h = tl.arange(0, HEADS_BLOCK)
    d = tl.arange(0, DIM_BLOCK)
    row = h[:, None].to(tl.int64) * head_stride + d[None, :]
    in_row = (h[:, None] < heads) & (d[None, :] < head_dim)
    context = tl.load(context_ptr + request).to(tl.int64)
    blocks = block_table_ptr + request.to(tl.int64) * block_table_stride
    for j in tl.static_range(DEPTH):
        node = tl.load(path_ptr + request.to(tl.int64) * path_stride + j)
        src = context + node
        dst = context + j + 1
        move = (node >= 0) & (src != dst)
        src_block = tl.load(blocks + src // BLOCK_SIZE, mask=move, other=0).to(tl.int64)
        dst_block = tl.load(blocks + dst // BLOCK_SIZE, mask=move, other=0).to(tl.int64)
        src_row = cache + src_block * block_stride + (src % BLOCK_SIZE) * slot_stride
        dst_row = cache + dst_block * block_stride + (dst % BLOCK_SIZE) * slot_stride
        copy = in_row & (tl.zeros_like(in_row) | move)  # the scalar as a block (Triton's interpreter)
        values = tl.load(src_row + row, mask=copy)
        tl.store(dst_row + row, values, mask=copy)
