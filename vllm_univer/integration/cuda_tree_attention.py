"""Tree rows inside vLLM's CUDA attention backends (FlashAttention, Triton).

Both read the layer's cache as ``kv_cache.transpose(1, 2).split(head_size, -1)``
and causal masks only. By the time ``forward`` runs, vLLM has written the
forward's new keys/values into the cache (``do_kv_cache_update``), so every tree
key is cached at position L + k; the tree rows of a ``TreeAttentionPlan`` are
computed by the Triton kernel ``paged_tree_attention_triton`` straight over the
paged cache and written into the backend's output (no gather of the context).
"""

from __future__ import annotations

import torch

from ..kernels.triton_paged_tree_attention import paged_tree_attention_triton
from .kv_cache_views import standard_kv_views
from .tree_attention_plan import TreeAttentionPlan


def forward_tree_rows(impl, layer, query, key, value, kv_cache, attn_metadata, output, plan: TreeAttentionPlan) -> None:
    """Overwrite ``output`` at the plan's rows with exact tree attention.

    query [tokens, Hq, Dh]; kv_cache [num_blocks, Hkv, block_size, 2*Dh] with the
    new keys/values written; output [tokens, Hq*Dh] or [tokens, Hq, Dh].
    """
    heads, head_size = impl.num_heads, impl.head_size
    key_cache, value_cache = standard_kv_views(kv_cache, head_size)
    # What every layer reads alike, converted once per forward (not once per layer).
    table = attn_metadata.block_table
    block_table = plan.derived(("block_table", id(table)), lambda: table[plan.request_index])
    mask = plan.derived("mask_int8", lambda: plan.mask.to(torch.int8).contiguous())
    row_valid = plan.row_valid
    if row_valid is not None:
        row_valid = plan.derived("row_valid_int8", lambda: plan.row_valid.to(torch.int8))
    paged_tree_attention_triton(
        query.view(-1, heads, head_size),
        key_cache,
        value_cache,
        block_table,
        plan.context_lens,
        plan.query_rows,
        mask,
        output.view(-1, heads, head_size),
        scale=impl.scale,
        row_valid=row_valid,
        max_context_len=plan.max_context_len,
    )
