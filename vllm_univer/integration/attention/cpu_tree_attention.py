"""Tree rows inside vLLM's CPU attention backend.

vLLM's CPU kernel (``cpu_attention_with_kv_cache``) knows causal masks only. The
tree rows of a ``TreeAttentionPlan`` read every key (context and tree, which
vLLM has just cached at positions L + k) from the paged cache in whole blocks,
straight from the attention ISA's layout (``gather_cpu_blocks``), and attend
under the plan's mask (``masked_attention``: PyTorch's fused kernel).
"""

from __future__ import annotations

from .kv_cache_views import gather_cpu_blocks
from .tree_attention import cached_tree_key_mask, masked_attention
from .tree_attention_plan import TreeAttentionPlan
from .tree_graph_plans import GraphTreePlan


def forward_tree_rows(
    impl, layer, query, key, value, kv_cache, attn_metadata, output, plan: TreeAttentionPlan | GraphTreePlan
) -> None:
    """Overwrite ``output`` at the plan's rows with exact tree attention.

    query [tokens, Hq, Dh], key/value [tokens, Hkv, Dh] (already in ``kv_cache``),
    kv_cache [num_blocks, Hkv, block_size, 2*Dh] as vLLM's CPU backend holds it,
    output [tokens, Hq*Dh] or [tokens, Hq, Dh]. A ``GraphTreePlan`` (the persistent
    buffers a captured forward reads, emulated on CPU by the tests of the draft
    levels' graphs) is read as the plan written into it.
    """
    heads, head_size = impl.num_heads, impl.head_size
    block_size = kv_cache.shape[2]
    if isinstance(plan, GraphTreePlan):
        plan, block_table = plan.written_plan()
    else:
        block_table = attn_metadata.block_table[plan.request_index]
    # Blocks that hold the longest context and its tree keys (the rest of a shorter
    # request's blocks, and any past its own, are masked out).
    num_blocks = min(-(-(plan.max_context_len + plan.mask.shape[-1]) // block_size), block_table.shape[1])
    # One workspace and one key mask per forward, shared by its layers.
    workspace = plan.derived("cpu_gather_workspace", dict)
    keys, values = gather_cpu_blocks(kv_cache, layer.isa, block_table[:, :num_blocks], workspace)
    visible = plan.derived(
        ("cpu_key_mask", num_blocks * block_size),
        lambda: cached_tree_key_mask(plan.context_lens, plan.mask, num_blocks * block_size),
    )
    q = query.view(-1, heads, head_size)[plan.query_rows]
    out = masked_attention(q, keys, values, visible, scale=impl.scale)
    flat_out = output.view(-1, heads, head_size)
    if plan.row_valid is None:
        flat_out[plan.query_rows.flatten()] = out.flatten(0, 1).to(flat_out.dtype)
    else:
        flat_out[plan.query_rows[plan.row_valid]] = out[plan.row_valid].to(flat_out.dtype)
