"""vLLM's own attention kernels over a paged cache, called as its backends call
them: the bar that tree attention is timed against (issue 12: per layer at most
1.5x vLLM's kernel on the same query rows and contexts, FLASH_ATTN and TRITON_ATTN).

Both take ``t`` query tokens per request in one flat batch (request r's at rows
r*t .. r*t+t-1), causal over the request's context and its own earlier query
tokens: a chain of t - 1 drafts, the same query rows and keys as a tree of t nodes.

    query [R*t, Hq, Dh]; keys / values [blocks, block, Hkv, Dh] (vLLM's views of
    its cache); block_table [R, blocks] int32; context_lens [R] (keys before the
    query tokens). Each function returns a callable that writes ``out`` [R*t, Hq, Dh].
"""

from __future__ import annotations

import torch


def _causal_call(query, keys, values, block_table, context_lens, t: int, out, scale: float) -> dict:
    """The arguments both of vLLM's kernels take alike (same names, same meaning)."""
    reqs = context_lens.shape[0]
    seqused_k = (context_lens + t).to(torch.int32)
    return dict(
        q=query,
        k=keys,
        v=values,
        out=out,
        cu_seqlens_q=torch.arange(0, reqs * t + 1, t, dtype=torch.int32, device=query.device),
        max_seqlen_q=t,
        seqused_k=seqused_k,
        max_seqlen_k=int(seqused_k.max()),
        softmax_scale=scale,
        causal=True,
        block_table=block_table,
    )


def triton_attn_causal(query, keys, values, block_table, context_lens, t: int, out, scale: float):
    """TRITON_ATTN's kernel (``unified_attention``), as ``TritonAttentionImpl.forward`` calls it."""
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    call = _causal_call(query, keys, values, block_table, context_lens, t, out, scale)
    descale = torch.ones(1, device=query.device).expand(context_lens.shape[0], keys.shape[2])
    call.update(window_size=(-1, -1), softcap=0, q_descale=None, k_descale=descale, v_descale=descale)
    return lambda: unified_attention(**call)


def flash_attn_causal(query, keys, values, block_table, context_lens, t: int, out, scale: float, fa_version=3):
    """FLASH_ATTN's kernel (vLLM's FlashAttention extension, ``flash_attn_varlen_func``)."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    call = _causal_call(query, keys, values, block_table, context_lens, t, out, scale)
    return lambda: flash_attn_varlen_func(**call, fa_version=fa_version)


def chain_matches_triton_attn(device, dtype, gen, reqs: int = 3, context: int = 40, t: int = 6, **shape) -> float:
    """Max difference between the package's paged tree-attention kernel on a chain of
    t - 1 drafts (tree attention then is causal attention) and ``triton_attn_causal``
    on the same rows: the two are timed against each other as like for like."""
    from vllm_univer import TreeSpec
    from vllm_univer.integration.attention.triton_paged_tree_attention import paged_tree_attention_triton

    hq, hkv, dh, bs = shape.get("hq", 4), shape.get("hkv", 2), shape.get("dh", 32), shape.get("bs", 16)
    lens = torch.randint(1, context, (reqs,), generator=gen)
    per_req = -(-(context + t) // bs)
    table = torch.randperm(reqs * per_req, generator=gen).view(reqs, per_req).int().to(device)
    kv = torch.randn(reqs * per_req, hkv, bs, 2 * dh, generator=gen).to(device, dtype)
    keys, values = kv.transpose(1, 2).split(dh, dim=-1)
    query = torch.randn(reqs * t, hq, dh, generator=gen).to(device, dtype)
    lens = lens.to(device)
    mask = TreeSpec.parse(f"1x{t - 1}").ancestor_mask.to(device)
    rows = torch.arange(reqs * t, device=device).view(reqs, t)
    ours, theirs = torch.zeros_like(query), torch.zeros_like(query)
    scale = dh**-0.5
    paged_tree_attention_triton(
        query, keys, values, table, lens, rows, mask, ours, scale=scale, max_context_len=context
    )
    triton_attn_causal(query, keys, values, table, lens, t, theirs, scale)()
    return float((ours.double() - theirs.double()).abs().max())
