"""Triton kernel for the tree part of tree attention (the GPU path's building block).

Same contract as ``tree_attention.tree_self_attention``: the T tree queries of a
request attend to the T tree keys with the ancestor mask, and the kernel returns
the output and its log-sum-exp so that it merges exactly with the paged-context
part (``merge_attention_states``, or vLLM's ``merge_attn_states`` on CUDA).
One program per (request, query head) holds the whole tree (T <= 129 tokens) in
registers / shared memory: the tree part is small, the context part is the big one.

Not wired into vLLM yet (the CUDA engine path is open work); tested against the
PyTorch reference with ``TRITON_INTERPRET=1`` on CPU and on CUDA by
``benchmarks/gpu_check.py`` when a GPU is available.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _tree_self_attention_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, lse_ptr,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh,
    stride_lb, stride_lt,
    num_tokens, head_size, groups, scale,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    kv_h = h // groups
    t = tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    t_ok = t < num_tokens
    d_ok = d < head_size
    tile = t_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + t[:, None] * stride_qt + d[None, :], mask=tile, other=0.0)
    k = tl.load(k_ptr + b * stride_kb + kv_h * stride_kh + t[:, None] * stride_kt + d[None, :], mask=tile, other=0.0)
    v = tl.load(v_ptr + b * stride_vb + kv_h * stride_vh + t[:, None] * stride_vt + d[None, :], mask=tile, other=0.0)
    scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32))) * scale  # [T, T]
    visible = tl.load(mask_ptr + t[:, None] * num_tokens + t[None, :], mask=t_ok[:, None] & t_ok[None, :], other=0)
    scores = tl.where(visible != 0, scores, float("-inf"))
    row_max = tl.max(scores, axis=1)
    safe_max = tl.where(row_max == float("-inf"), 0.0, row_max)
    weights = tl.exp(scores - safe_max[:, None])
    total = tl.sum(weights, axis=1)
    safe_total = tl.where(total > 0, total, 1.0)  # padding rows see no key
    out = tl.dot(weights, v.to(tl.float32)) / safe_total[:, None]
    lse = tl.where(total > 0, safe_max + tl.log(safe_total), float("-inf"))
    tl.store(out_ptr + b * stride_ob + h * stride_oh + t[:, None] * stride_ot + d[None, :], out, mask=tile)
    tl.store(lse_ptr + b * stride_lb + t * stride_lt + h, lse, mask=t_ok)


def tree_self_attention_triton(query: torch.Tensor, tree_keys: torch.Tensor, tree_values: torch.Tensor,
                               ancestor_mask: torch.Tensor, scale: float | None = None):
    """query [B, T, Hq, Dh]; tree_keys/values [B, T, Hkv, Dh]; ancestor_mask [T, T] bool
    -> (out [B, T, Hq, Dh] float32, lse [B, T, Hq] float32). Rows with no visible
    key give out 0 and lse -inf (never the case for a tree: a node sees itself)."""
    batch, tokens, heads, head_size = query.shape
    kv_heads = tree_keys.shape[2]
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of key/value heads ({kv_heads})")
    if ancestor_mask.shape != (tokens, tokens):
        raise ValueError(f"ancestor_mask must be [{tokens}, {tokens}], got {tuple(ancestor_mask.shape)}")
    scale = scale if scale is not None else 1.0 / math.sqrt(head_size)
    query, tree_keys, tree_values = (x if x.stride(-1) == 1 else x.contiguous()
                                     for x in (query, tree_keys, tree_values))
    mask = ancestor_mask.to(device=query.device, dtype=torch.int8).contiguous()
    out = torch.empty(batch, tokens, heads, head_size, device=query.device, dtype=torch.float32)
    lse = torch.empty(batch, tokens, heads, device=query.device, dtype=torch.float32)
    block_t = max(16, triton.next_power_of_2(tokens))
    block_d = max(16, triton.next_power_of_2(head_size))
    _tree_self_attention_kernel[(batch, heads)](
        query, tree_keys, tree_values, mask, out, lse,
        query.stride(0), query.stride(1), query.stride(2),
        tree_keys.stride(0), tree_keys.stride(1), tree_keys.stride(2),
        tree_values.stride(0), tree_values.stride(1), tree_values.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        tokens, head_size, heads // kv_heads, scale,
        BLOCK_T=block_t, BLOCK_D=block_d,
    )
    return out, lse
