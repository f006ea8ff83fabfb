"""Tree attention over a paged KV cache.

A request with L cached context tokens verifies (or drafts) T = N+1 tree tokens
at positions L + depth. Tree token i attends to all L context tokens and to its
own ancestors in the tree (itself included), never to its siblings or cousins.

``tree_attention`` computes both in one softmax; the parts below, which merge
exactly through their log-sum-exp (cascade attention's "merge state"), are the
reference it is tested against:

* ``paged_context_attention``: the T queries over the request's L context keys,
  read through the block table, no mask inside the context;
* ``tree_self_attention``: the T queries over the T tree keys with the ancestor mask.

Layouts: queries [B, T, Hq, Dh]; tree keys/values [B, T, Hkv, Dh]; the paged
cache is [num_blocks, block_size, Hkv, Dh] (vLLM's NHD layout; other layouts
pass a view with this shape). Hq must be a multiple of Hkv (GQA).
"""

from __future__ import annotations

import math

import torch


def _expand_kv_heads(x: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """[B, S, Hkv, Dh] -> [B, S, Hq, Dh] (grouped-query attention)."""
    groups = num_q_heads // x.shape[2]
    return x if groups == 1 else x.repeat_interleave(groups, dim=2)


def _masked_attention(q, k, v, mask, scale):
    """q [B, T, H, Dh], k/v [B, S, H, Dh], mask [B or 1, T, S] bool ->
    (out [B, T, H, Dh], lse [B, T, H]); rows with no visible key give out 0, lse -inf."""
    scores = torch.einsum("bthd,bshd->bhts", q.float(), k.float()) * scale
    scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, H, T]
    # Clamping lse keeps fully masked rows at exp(-inf - finite) = 0 instead of NaN.
    weights = torch.exp(scores - lse.unsqueeze(-1).clamp(min=torch.finfo(torch.float32).min))
    out = torch.einsum("bhts,bshd->bthd", weights, v.float())
    return out, lse.transpose(1, 2)


def gather_paged(cache: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Read cache entries at logical ``positions`` through the block table.

    cache [num_blocks, block_size, Hkv, Dh], block_table [B, max_blocks] (int),
    positions [B, S] (long, >= 0) -> [B, S, Hkv, Dh].
    """
    block_size = cache.shape[1]
    blocks = block_table.long().gather(1, positions // block_size)
    # Index (block, offset) directly: ``cache`` may be a strided view of a
    # differently laid-out cache, which a reshape would copy whole.
    return cache[blocks, positions % block_size]


def gather_context(cache, block_table: torch.Tensor, context_lens: torch.Tensor, max_len: int):
    """Read each request's first ``max_len`` cached tokens through its block table.

    cache [num_blocks, block_size, Hkv, Dh] (a tensor view, or any cache whose
    ``cache[blocks]`` reads whole blocks, ``kv_cache_views.TiledPagedCache``),
    block_table [B, max_blocks] (int), context_lens [B] ->
    ([B, max_len, Hkv, Dh], valid [B, max_len] bool).

    Whole blocks are copied (one index on the block axis), not token by token:
    the same bytes, far fewer index computations.
    """
    pos = torch.arange(max_len, device=cache.device)
    valid = pos.unsqueeze(0) < context_lens.unsqueeze(1)
    num_blocks = -(-max_len // cache.shape[1])
    # A request with a shorter context reads whatever block ids its row holds past
    # its own (vLLM zero-fills them): valid entries of some block, masked out.
    blocks = cache[block_table[:, :num_blocks].long()]  # [B, num_blocks, block_size, Hkv, Dh]
    return blocks.flatten(1, 2)[:, :max_len], valid


def paged_context_attention(query, key_cache, value_cache, block_table, context_lens, scale=None, max_context_len=None):
    """Attention of the tree queries over the cached context.

    query [B, T, Hq, Dh]; caches [num_blocks, block_size, Hkv, Dh];
    block_table [B, max_blocks]; context_lens [B] -> (out [B, T, Hq, Dh] fp32, lse [B, T, Hq] fp32).
    ``max_context_len`` (a Python int) avoids a host sync when the caller knows it.
    """
    scale = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    max_len = int(max_context_len) if max_context_len is not None else int(context_lens.max())
    if max_len == 0:
        b, t, h, d = query.shape
        return query.new_zeros(b, t, h, d, dtype=torch.float32), query.new_full(
            (b, t, h), float("-inf"), dtype=torch.float32
        )
    keys, valid = gather_context(key_cache, block_table, context_lens, max_len)
    values, _ = gather_context(value_cache, block_table, context_lens, max_len)
    heads = query.shape[2]
    mask = valid.unsqueeze(1).expand(-1, query.shape[1], -1)
    return _masked_attention(query, _expand_kv_heads(keys, heads), _expand_kv_heads(values, heads), mask, scale)


def tree_self_attention(query, tree_keys, tree_values, ancestor_mask, scale=None):
    """Attention of the tree queries over the tree's own keys with the ancestor mask.

    query [B, T, Hq, Dh]; tree_keys/values [B, T, Hkv, Dh]; ancestor_mask [T, T] or
    [B, T, T] bool (mask[i, j] = j is i or an ancestor of i) -> (out, lse) as above.
    """
    scale = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    heads = query.shape[2]
    mask = ancestor_mask if ancestor_mask.dim() == 3 else ancestor_mask.unsqueeze(0)
    return _masked_attention(
        query, _expand_kv_heads(tree_keys, heads), _expand_kv_heads(tree_values, heads), mask, scale
    )


def merge_attention_states(out_a, lse_a, out_b, lse_b):
    """Combine two attention results over disjoint key sets exactly.

    out_* [..., H, Dh], lse_* [..., H] -> (out, lse). Either side may be empty (lse = -inf).
    """
    lse = torch.logaddexp(lse_a, lse_b)
    finite = torch.isfinite(lse)
    safe = torch.where(finite, lse, torch.zeros_like(lse))
    w_a = torch.where(finite, torch.exp(lse_a - safe), torch.zeros_like(lse)).unsqueeze(-1)
    w_b = torch.where(finite, torch.exp(lse_b - safe), torch.zeros_like(lse)).unsqueeze(-1)
    return out_a * w_a + out_b * w_b, lse


def attention_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype tree attention computes in: 16-bit models in their own dtype, as
    vLLM's kernels do (the fused kernel accumulates in float32: half the bytes moved,
    twice the matmul rate); float32 and float64 as they are."""
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.promote_types(dtype, torch.float32)


def cached_tree_key_mask(context_lens: torch.Tensor, ancestor_mask: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Which of a request's first ``num_keys`` cached positions each tree query sees,
    when the tree keys are cached right after the context (tree key k at position L + k).

    context_lens [B] (L), ancestor_mask [Tq, Tk] bool (query j sees tree key k), or
    [B, Tq, Tk] (one per request) -> [B, Tq, num_keys] bool: position s is visible
    to query j iff s < L, or s = L + k with ancestor_mask[j, k]. Positions past
    L + Tk are not.
    """
    tree_keys = ancestor_mask.shape[-1]
    rel = torch.arange(num_keys, device=context_lens.device).unsqueeze(0) - context_lens.unsqueeze(1)  # [B, S]
    in_tree = (rel >= 0) & (rel < tree_keys)
    key = rel.clamp(0, tree_keys - 1)
    if ancestor_mask.dim() == 3:
        tree_visible = ancestor_mask.gather(2, key.unsqueeze(1).expand(-1, ancestor_mask.shape[1], -1))
    else:
        tree_visible = ancestor_mask[:, key].transpose(0, 1)
    tree_visible = tree_visible & in_tree.unsqueeze(1)  # [B, Tq, S]
    return tree_visible | (rel < 0).unsqueeze(1)


def masked_attention(query, keys, values, visible, scale=None):
    """Attention of each request's queries over its own keys, under a mask.

    query [B, T, Hq, Dh]; keys/values [B, S, Hkv, Dh] (any strides: keys stored
    head-major, [Hkv, B, S, Dh], are read without a copy); visible [B, T, S] bool,
    at least one key visible per query -> out [B, T, Hq, Dh] in the query's dtype.

    One ``scaled_dot_product_attention`` (PyTorch's fused CPU kernel: float32
    scores and accumulation) in ``attention_dtype``, the G = Hq / Hkv query heads
    of each key head folded into its query rows ([B, Hkv, G*T, Dh]): on CPU,
    2-2.5x faster than the kernel's own grouped-query path at T <= 11.
    """
    scale = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    dtype = attention_dtype(query.dtype)
    batch, t, heads, head_size = query.shape
    kv_heads = keys.shape[2]
    groups = heads // kv_heads
    folded = (
        query.view(batch, t, kv_heads, groups, head_size).permute(0, 2, 3, 1, 4).reshape(batch, kv_heads, -1, head_size)
    )
    mask = visible.unsqueeze(1).expand(batch, groups, t, visible.shape[-1]).reshape(batch, 1, groups * t, -1)
    out = torch.nn.functional.scaled_dot_product_attention(
        folded.to(dtype), keys.transpose(1, 2).to(dtype), values.transpose(1, 2).to(dtype), attn_mask=mask, scale=scale
    )  # [B, Hkv, G*T, Dh]
    return out.view(batch, kv_heads, groups, t, head_size).permute(0, 3, 1, 2, 4).reshape(query.shape).to(query.dtype)


def tree_attention(
    query,
    tree_keys,
    tree_values,
    key_cache,
    value_cache,
    block_table,
    context_lens,
    ancestor_mask,
    scale=None,
    max_context_len=None,
):
    """Full tree attention, context and tree keys in one softmax. Shapes as above;
    returns out [B, T, Hq, Dh] in the query's dtype.

    The cached context is gathered once (padded to the longest, padding masked),
    the tree keys appended, and ``masked_attention`` runs over [context ; tree]
    with the ancestor mask on the tree part. Equal to ``paged_context_attention``
    and ``tree_self_attention`` merged through their log-sum-exp; a dozen ATen ops
    per call instead of ~40 over materialised [B, H, T, L] scores. (vLLM's CPU
    backend reads its own cache layout faster: ``cpu_tree_attention``.)
    """
    max_len = int(max_context_len) if max_context_len is not None else int(context_lens.max())
    batch, t = query.shape[:2]
    keys, valid = gather_context(key_cache, block_table, context_lens, max_len)  # [B, L, Hkv, Dh], [B, L]
    values, _ = gather_context(value_cache, block_table, context_lens, max_len)
    tree_mask = ancestor_mask if ancestor_mask.dim() == 3 else ancestor_mask.unsqueeze(0)
    visible = torch.cat([valid.unsqueeze(1).expand(-1, t, -1), tree_mask.expand(batch, -1, -1)], 2)  # [B, T, L+T]
    keys, values = torch.cat([keys, tree_keys], 1), torch.cat([values, tree_values], 1)
    return masked_attention(query, keys, values, visible, scale)
