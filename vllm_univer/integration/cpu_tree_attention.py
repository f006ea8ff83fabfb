"""Tree attention inside vLLM's CPU attention backend.

vLLM's CPU kernel (``cpu_attention_with_kv_cache``) knows causal masks only. A
forward that carries tree tokens attaches a ``TreeAttentionPlan`` to its
attention metadata (``metadata.tree_plan``); the patched backend lets vLLM write
the new keys/values into the paged cache as usual, runs vLLM's kernel for the
ordinary rows of the batch, then recomputes the tree rows with
``kernels.tree_attention`` over zero-copy views of the same cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.tree_attention import gather_paged, tree_attention
from .cpu_kv_cache import cpu_kv_views


@dataclass
class TreeAttentionPlan:
    """Which rows of a forward are tree tokens, and what each may see.

    query_rows: LongTensor [R, Tq], rows of the forward's flat token batch, per
        tree request (padding rows repeat a valid row and are not written back).
    row_valid: BoolTensor [R, Tq] or None (all valid).
    request_index: LongTensor [R], each tree request's row in the metadata's block table.
    context_lens: LongTensor [R], L: cached tokens every tree token sees in full.
    mask: BoolTensor [Tq, Tk], query j may see tree key k (ancestors and itself).
    keys_from_rows: True when the tree keys are the query rows' own new keys
        (verification: Tk = Tq); False when they are read from the cache at
        positions L .. L+Tk-1 (drafting one level: earlier levels are cached).
    covers_all_rows: every row of the forward is a tree row (skip vLLM's kernel).
    max_context_len: Python int bound on context_lens (avoids a host sync).
    """

    query_rows: torch.Tensor
    row_valid: torch.Tensor | None
    request_index: torch.Tensor
    context_lens: torch.Tensor
    mask: torch.Tensor
    keys_from_rows: bool
    covers_all_rows: bool
    max_context_len: int


def check_layer_supported(impl) -> None:
    """Refuse attention features the tree kernels do not implement, at start-up."""
    unsupported = []
    if getattr(impl, "sliding_window", -1) not in (-1, None):
        unsupported.append("sliding windows")
    if getattr(impl, "logits_soft_cap", 0):
        unsupported.append("logit soft-capping")
    if getattr(impl, "alibi_slopes", None) is not None:
        unsupported.append("ALiBi")
    if getattr(impl, "sinks", None) is not None:
        unsupported.append("attention sinks")
    if getattr(impl, "is_fp8_kv_cache", False):
        unsupported.append("fp8 KV cache")
    if unsupported:
        raise NotImplementedError(
            f"tree speculation (method 'univer') does not support {', '.join(unsupported)} "
            "in the CPU attention backend yet"
        )


def forward_tree_rows(impl, layer, query, key, value, kv_cache, attn_metadata, output,
                      plan: TreeAttentionPlan) -> None:
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
    out = tree_attention(q, tree_k, tree_v, key_cache, value_cache, block_table, plan.context_lens,
                         plan.mask, scale=impl.scale, max_context_len=plan.max_context_len)
    flat_out = output.view(-1, heads, head_size)
    if plan.row_valid is None:
        flat_out[plan.query_rows.flatten()] = out.flatten(0, 1).to(flat_out.dtype)
    else:
        flat_out[plan.query_rows[plan.row_valid]] = out[plan.row_valid].to(flat_out.dtype)
