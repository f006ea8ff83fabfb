"""Keep the accepted path's keys/values: move them to the first consecutive slots.

A request with L cached tokens wrote its tree tokens 0..N (0 = the last
committed token) at logical positions L..L+N. If the step accepts the path
root -> a_1 -> ... -> a_k (a_j at depth j), the engine keeps positions
L..L+k and frees the rest (vLLM's rollback of num_computed_tokens), so the KV
of node a_j must move from L + a_j to L + j. Breadth-first numbering gives
a_j >= j, so no move overwrites a source that a later move still reads; the
moves are applied as one gather then one scatter anyway.
"""

from __future__ import annotations

import torch


def accepted_path_moves(context_lens: torch.Tensor, path_nodes: torch.Tensor):
    """Moves for a batch of accepted paths.

    context_lens [B] (L per request); path_nodes [B, D] (node at depth j+1 of
    the accepted path, -1 past its end; e.g. ``TreeSpec.ancestors[end_node]``) ->
    (request [M], src [M], dst [M]) logical positions; moves with src == dst are dropped.
    No host sync except the final compaction of the move list.
    """
    depth = torch.arange(1, path_nodes.shape[1] + 1, device=path_nodes.device)
    src = context_lens.unsqueeze(1) + path_nodes
    dst = context_lens.unsqueeze(1) + depth.unsqueeze(0)
    keep = (path_nodes >= 0) & (src != dst)
    request = torch.arange(path_nodes.shape[0], device=path_nodes.device).unsqueeze(1).expand_as(path_nodes)
    return request[keep], src[keep], dst[keep]


def move_paged_kv(
    caches: torch.Tensor | list | tuple,
    block_table: torch.Tensor,
    request: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
) -> None:
    """Copy cache entries of logical positions ``src`` to ``dst`` (in place), in
    one cache or in each of ``caches`` (every layer's K and V).

    cache: [num_blocks, block_size, ...] (a view of a layer's K or V cache);
    block_table [B, max_blocks]; request, src, dst [M] as from ``accepted_path_moves``.
    The physical slots are computed once per block size, not per cache: per
    cache the move is one gather and one scatter.
    """
    if request.numel() == 0:
        return
    slots: dict[int, tuple] = {}
    # A cache is a tensor or a tensor-like view (``TiledPagedCache``: vLLM's amx
    # layout); a list or tuple holds several.
    for cache in caches if isinstance(caches, (list, tuple)) else [caches]:
        block_size = cache.shape[1]
        if block_size not in slots:
            src_block = block_table[request, src // block_size].long()
            dst_block = block_table[request, dst // block_size].long()
            slots[block_size] = (src_block, src % block_size, dst_block, dst % block_size)
        src_block, src_off, dst_block, dst_off = slots[block_size]
        cache[dst_block, dst_off] = cache[src_block, src_off]  # gather first: moves never read what they wrote
