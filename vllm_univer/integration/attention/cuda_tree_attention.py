"""Tree rows inside vLLM's CUDA attention backends (FlashAttention, Triton).

Both read the layer's cache as ``kv_cache.transpose(1, 2).split(head_size, -1)``
and causal masks only. By the time ``forward`` runs, vLLM has written the
forward's new keys/values into the cache (``do_kv_cache_update``), so every tree
key is cached at position L + k; the tree rows of a ``TreeAttentionPlan`` are
computed by the Triton kernel ``paged_tree_attention_triton`` straight over the
paged cache and written into the backend's output (no gather of the context).
"""

from __future__ import annotations

from .kv_cache_views import standard_kv_views
from .persistent_tree_attention import PersistentTreeAttention
from .tree_attention_plan import TreeAttentionPlan
from .tree_graph_plans import GraphTreePlan
from .triton_paged_tree_attention import PagedTreeAttention


def forward_tree_rows(
    impl, layer, query, key, value, kv_cache, attn_metadata, output, plan: TreeAttentionPlan | GraphTreePlan
) -> None:
    """Overwrite ``output`` at the plan's rows with exact tree attention.

    query [tokens, Hq, Dh]; kv_cache [num_blocks, Hkv, block_size, 2*Dh] with the
    new keys/values written; output [tokens, Hq*Dh] or [tokens, Hq, Dh].
    """
    heads, head_size = impl.num_heads, impl.head_size
    key_cache, value_cache = standard_kv_views(kv_cache, head_size)
    query, output = query.view(-1, heads, head_size), output.view(-1, heads, head_size)
    # The layers of a forward share everything but their query, cache and output:
    # the kernel's launch is prepared by the first layer (block table rows, int8
    # masks, strides, key splits: PagedTreeAttention) and reused by the others. Keyed by what the
    # preparation read of the layer's tensors, should a model mix layer shapes.
    layout = (query.shape, query.stride(), key_cache.shape, key_cache.stride(), value_cache.stride())
    layout = (*layout, output.stride(), query.dtype, impl.scale)
    if isinstance(plan, GraphTreePlan):  # a full CUDA graph: the launch reads the captured size's buffers
        attention = plan.derived(
            layout, lambda: PersistentTreeAttention(plan.buffers, query, key_cache, value_cache, output, impl.scale)
        )
    else:
        attention = plan.derived(
            ("tree_attention", id(attn_metadata.block_table), layout),
            lambda: _prepare(plan, attn_metadata.block_table, query, key_cache, value_cache, output, impl.scale),
        )
    attention(query, key_cache, value_cache, output)


def _prepare(plan: TreeAttentionPlan, table, query, key_cache, value_cache, output, scale) -> PagedTreeAttention:
    return PagedTreeAttention(
        query,
        key_cache,
        value_cache,
        table[plan.request_index],
        plan.context_lens,
        plan.query_rows,
        plan.mask,
        output,
        scale=scale,
        row_valid=plan.row_valid,
        max_context_len=plan.max_context_len,
    )
