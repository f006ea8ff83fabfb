"""Tree rows inside vLLM's CPU attention backend.

vLLM's CPU kernel (``cpu_attention_with_kv_cache``) knows causal masks only; the
tree rows of a ``TreeAttentionPlan`` are computed with ``kernels.tree_attention``
(PyTorch) over zero-copy views of the same cache.
"""

from __future__ import annotations

import torch

from ..kernels.tree_attention import gather_paged, tree_attention
from .kv_cache_views import cpu_kv_views
from .tree_attention_plan import TreeAttentionPlan


def forward_tree_rows(impl, layer, query, key, value, kv_cache, attn_metadata, output, plan: TreeAttentionPlan) -> None:
    """Overwrite ``output`` at the plan's rows with exact tree attention.

    query [tokens, Hq, Dh], key/value [tokens, Hkv, Dh], kv_cache as vLLM's CPU
    backend holds it (the new keys/values already written), output [tokens, Hq*Dh]
    or [tokens, Hq, Dh].
    """
    heads, head_size = impl.num_heads, impl.head_size
    key_cache, value_cache = cpu_kv_views(kv_cache, layer.isa)
    block_table = attn_metadata.block_table[plan.request_index]
    q = query.view(-1, heads, head_size)[plan.query_rows]
    if plan.keys_from_rows:
        kv_heads = impl.num_kv_heads
        tree_k = key.view(-1, kv_heads, head_size)[plan.query_rows]
        tree_v = value.view(-1, kv_heads, head_size)[plan.query_rows]
    else:
        positions = plan.context_lens.unsqueeze(1) + torch.arange(plan.mask.shape[1], device=query.device)
        tree_k = gather_paged(key_cache, block_table, positions)
        tree_v = gather_paged(value_cache, block_table, positions)
    out = tree_attention(
        q,
        tree_k,
        tree_v,
        key_cache,
        value_cache,
        block_table,
        plan.context_lens,
        plan.mask,
        scale=impl.scale,
        max_context_len=plan.max_context_len,
    )
    flat_out = output.view(-1, heads, head_size)
    if plan.row_valid is None:
        flat_out[plan.query_rows.flatten()] = out.flatten(0, 1).to(flat_out.dtype)
    else:
        flat_out[plan.query_rows[plan.row_valid]] = out[plan.row_valid].to(flat_out.dtype)
