"""Triton kernel: tree attention straight over a paged KV cache (the CUDA path).

Same law as ``tree_attention.tree_attention``, in one pass and without gathering
the context: a request with L cached context tokens has its tree keys cached at
positions L .. L+Tk-1 (tree key j at L + j); tree query t sees every context
position < L and the tree keys j with ``ancestor_mask[t, j]``. Softmax is online
(flash-attention style, float32 statistics), keys are read through the block
table, and the result is written into the engine's output tensor at the query's
own row, so ordinary rows of the same forward are left to the engine's kernel.

One program per (request, KV head, tile of BLOCK_M query rows), where a query
row is one (tree token, query head of the KV head's group) pair: grouped-query
attention reads every key once per group. When that is too few programs for the
GPU (a few requests over long contexts), the keys are split across programs
(flash-decoding) and the partial results merged by log-sum-exp.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...core.kernels.checks import FLOATS, expect


@triton.jit
def _paged_tree_attention_kernel(
    q_ptr,  # [T, Hq, Dh] the forward's queries (Dh contiguous)
    k_ptr,  # [num_blocks, block_size, Hkv, Dh] key cache, any strides
    v_ptr,  # [num_blocks, block_size, Hkv, Dh] value cache, any strides
    out_ptr,  # [T, Hq, Dh] output (Dh contiguous); only tree rows are written
    block_table_ptr,  # [R, max_blocks] int: the tree requests' block table rows
    context_lens_ptr,  # [R] int: L per request; tree key j is cached at L + j
    query_rows_ptr,  # [R, Tq] int64: flat row of tree query t of request r
    row_valid_ptr,  # [R, Tq] int8: rows to compute (read if HAS_ROW_VALID)
    mask_ptr,  # [R or 1, Tq, Tk] int8, (Tq, Tk) contiguous: query t sees tree key j
    stride_mr,  # mask stride per request: 0 where every request shares one mask
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_qr,
    stride_rv,
    part_out_ptr,  # [R, S, Tq, Hq, Dh] float32: per key split output (read if NUM_SPLITS > 1)
    part_lse_ptr,  # [R, S, Tq, Hq] float32: per key split log-sum-exp (read if NUM_SPLITS > 1)
    stride_pr,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_lr,
    stride_ls,
    stride_lt,
    num_queries,  # Tq: tree queries per request
    num_tree_keys,  # Tk: tree keys per request
    head_size,  # Dh
    groups,  # Hq / Hkv
    block_size,  # slots per cache block
    scale,  # softmax scale
    keys_per_split,  # keys one split walks (a multiple of BLOCK_N)
    HAS_ROW_VALID: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1) // NUM_SPLITS
    split = tl.program_id(1) % NUM_SPLITS
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    t = m // groups  # tree query of each row
    head = kv_head * groups + m % groups
    row_ok = t < num_queries
    if HAS_ROW_VALID:
        row_ok = row_ok & (tl.load(row_valid_ptr + req * stride_rv + t, mask=row_ok, other=0) != 0)
    token = tl.load(query_rows_ptr + req * stride_qr + t, mask=row_ok, other=0)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_size
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )

    context_len = tl.load(context_lens_ptr + req)
    total = context_len + num_tree_keys
    first_key = split * keys_per_split  # this program's share of the key positions
    end_key = tl.minimum(first_key + keys_per_split, total)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(first_key, end_key, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        in_range = pos < end_key
        block = tl.load(block_table_ptr + req * stride_bt + pos // block_size, mask=in_range, other=0).to(tl.int64)
        offset = pos % block_size
        kv_ok = in_range[:, None] & d_ok[None, :]
        k = tl.load(
            k_ptr
            + block[:, None] * stride_kb
            + offset[:, None] * stride_ks
            + kv_head * stride_kh
            + d[None, :] * stride_kd,
            mask=kv_ok,
            other=0.0,
        )
        v = tl.load(
            v_ptr
            + block[:, None] * stride_vb
            + offset[:, None] * stride_vs
            + kv_head * stride_vh
            + d[None, :] * stride_vd,
            mask=kv_ok,
            other=0.0,
        )
        if IEEE_DOT:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            scores = tl.dot(q, tl.trans(k)) * scale  # [BLOCK_M, BLOCK_N], float32 accumulation
        tree_key = pos - context_len
        in_tree = in_range & (tree_key >= 0)
        ancestor = (
            tl.load(
                mask_ptr + req * stride_mr + t[:, None] * num_tree_keys + tree_key[None, :],
                mask=row_ok[:, None] & in_tree[None, :],
                other=0,
            )
            != 0
        )
        visible = ((pos < context_len)[None, :] & row_ok[:, None]) | ancestor
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tile = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=tile,
        )
    else:  # a partial result and its log-sum-exp, merged by the caller
        tl.store(
            part_out_ptr
            + req * stride_pr
            + split * stride_ps
            + t[:, None] * stride_pt
            + head[:, None] * stride_ph
            + d[None, :],
            out,
            mask=tile,
        )
        lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + req * stride_lr + split * stride_ls + t * stride_lt + head, lse, mask=row_ok)


def paged_tree_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    query_rows: torch.Tensor,
    ancestor_mask: torch.Tensor,
    output: torch.Tensor,
    **options,
) -> None:
    """Write exact tree attention into ``output`` at the tree queries' rows.

    query [tokens, Hq, Dh] and output [tokens, Hq, Dh]: a forward's flat batch
        (last dimension contiguous); only rows named by ``query_rows`` are written.
    key_cache / value_cache [num_blocks, block_size, Hkv, Dh]: any strided view
        (vLLM's ``kv_cache.transpose(1, 2).split(head_size, -1)``).
    block_table [R, max_blocks] (int): the tree requests' rows of the block table.
    context_lens [R] (int): L per request; tree key j is cached at position L + j.
    query_rows [R, Tq] (long): flat row of tree query t of request r.
    ancestor_mask [Tq, Tk] bool (or int8): query t sees tree key j; or [R, Tq, Tk],
        one mask per request (per-request tree shapes).

    Options (keywords): scale (default 1 / sqrt(Dh)); row_valid [R, Tq] bool (or
    int8) or None: rows to compute (others are left untouched; int8 contiguous
    masks are read as they are, no conversion launch); max_context_len: a Python
    bound on context_lens (no host sync), with which few requests over long
    contexts split their keys across programs (num_splits, default chosen from
    the device's multiprocessor count), each writing a partial result that is
    merged by log-sum-exp.

    One call; a forward's layers share one ``PagedTreeAttention`` instead.
    """
    attention = PagedTreeAttention(
        query, key_cache, value_cache, block_table, context_lens, query_rows, ancestor_mask, output, **options
    )
    attention(query, key_cache, value_cache, output)


class PagedTreeAttention:
    """``paged_tree_attention_triton`` prepared once for every layer of a forward.

    The layers of a forward differ only in their query, cache and output tensors
    (same shapes and strides); everything else a launch needs (query rows, masks,
    block table, strides, grid, key splits, the splits' partial buffers) is built
    here once, so each layer's call is its launch alone. Arguments as in
    ``paged_tree_attention_triton``; the tensors given here fix the shapes and
    strides every later call's tensors must have.
    """

    def __init__(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
        query_rows: torch.Tensor,
        ancestor_mask: torch.Tensor,
        output: torch.Tensor,
        scale: float | None = None,
        row_valid: torch.Tensor | None = None,
        max_context_len: int | None = None,
        num_splits: int | None = None,
    ):
        tokens, heads, head_size = query.shape
        kv_heads = key_cache.shape[2]
        if heads % kv_heads:
            raise ValueError(f"query heads ({heads}) must be a multiple of key/value heads ({kv_heads})")
        num_reqs, num_queries = query_rows.shape
        if ancestor_mask.dim() == 3 and ancestor_mask.shape[0] != num_reqs:
            raise ValueError(f"ancestor_mask has {ancestor_mask.shape[0]} masks for {num_reqs} tree requests")
        if ancestor_mask.shape[-2] != num_queries:
            raise ValueError(f"ancestor_mask has {ancestor_mask.shape[-2]} rows for {num_queries} tree queries")
        expect("query", query, (tokens, heads, head_size), FLOATS, last_contiguous=True)
        expect("output", output, (tokens, heads, head_size), FLOATS, last_contiguous=True, device=query.device)
        expect("key_cache", key_cache, (None, None, kv_heads, head_size), FLOATS, device=query.device)
        expect("value_cache", value_cache, tuple(key_cache.shape), FLOATS, device=query.device)
        expect("block_table", block_table, (num_reqs, None), (torch.int32, torch.int64), device=query.device)
        expect("context_lens", context_lens, (num_reqs,), device=query.device)
        expect("row_valid", row_valid, (num_reqs, num_queries), (torch.bool, torch.int8))
        self.num_reqs = num_reqs
        if num_reqs == 0:
            return
        num_tree_keys = ancestor_mask.shape[-1]
        groups = heads // kv_heads
        scale = scale if scale is not None else 1.0 / math.sqrt(head_size)
        mask = ancestor_mask.to(device=query.device, dtype=torch.int8).contiguous()
        rows = query_rows.to(torch.int64)
        valid = row_valid.to(torch.int8) if row_valid is not None else None
        block_m, block_n = (32 if num_queries * groups > 16 else 16), 32
        block_d = max(16, triton.next_power_of_2(head_size))
        tiles = triton.cdiv(num_queries * groups, block_m)
        if num_splits is None:
            num_splits = _num_splits(query.device, num_reqs * kv_heads * tiles, max_context_len)
        self.num_splits = num_splits
        # With one split the kernel walks every key and has no partial results.
        keys_per_split, part_out, part_lse = 1 << 30, None, None
        part_out_strides, part_lse_strides = (0, 0, 0, 0), (0, 0, 0)
        if num_splits > 1:
            max_keys = (max_context_len if max_context_len is not None else 1 << 30) + num_tree_keys
            keys_per_split = triton.cdiv(triton.cdiv(max_keys, num_splits), block_n) * block_n
            # The splits' partial results: the layers run one after another on the stream and share them.
            part_out = torch.empty(
                num_reqs, num_splits, num_queries, heads, head_size, device=query.device, dtype=torch.float32
            )
            part_lse = torch.empty(num_reqs, num_splits, num_queries, heads, device=query.device, dtype=torch.float32)
            part_out_strides, part_lse_strides = part_out.stride()[:4], part_lse.stride()[:3]
        self.part_out, self.part_lse = part_out, part_lse
        self._grid = (num_reqs, kv_heads * num_splits, tiles)
        key_strides, value_strides = key_cache.stride(), value_cache.stride()
        # Every argument but the layer's own tensors (q_ptr, k_ptr, v_ptr, out_ptr).
        self._launch = dict(
            block_table_ptr=block_table,  # [R, max_blocks] int: the tree requests' block table rows
            context_lens_ptr=context_lens,  # [R] int: L per request; tree key j is cached at L + j
            query_rows_ptr=rows,  # [R, Tq] int64: flat row of tree query t of request r
            row_valid_ptr=valid,  # [R, Tq] int8: rows to compute (read if HAS_ROW_VALID)
            mask_ptr=mask,  # [R or 1, Tq, Tk] int8 contiguous: query t sees tree key j
            stride_mr=mask.stride(0) if mask.dim() == 3 else 0,  # 0: one mask for every request
            stride_qt=query.stride(0),
            stride_qh=query.stride(1),
            stride_kb=key_strides[0],
            stride_ks=key_strides[1],
            stride_kh=key_strides[2],
            stride_kd=key_strides[3],
            stride_vb=value_strides[0],
            stride_vs=value_strides[1],
            stride_vh=value_strides[2],
            stride_vd=value_strides[3],
            stride_ot=output.stride(0),
            stride_oh=output.stride(1),
            stride_bt=block_table.stride(0),
            stride_qr=rows.stride(0),
            stride_rv=valid.stride(0) if valid is not None else 0,
            part_out_ptr=part_out,  # [R, S, Tq, Hq, Dh] float32: per key split output (NUM_SPLITS > 1)
            part_lse_ptr=part_lse,  # [R, S, Tq, Hq] float32: per key split log-sum-exp (NUM_SPLITS > 1)
            stride_pr=part_out_strides[0],
            stride_ps=part_out_strides[1],
            stride_pt=part_out_strides[2],
            stride_ph=part_out_strides[3],
            stride_lr=part_lse_strides[0],
            stride_ls=part_lse_strides[1],
            stride_lt=part_lse_strides[2],
            num_queries=num_queries,  # Tq: tree queries per request
            num_tree_keys=num_tree_keys,  # Tk: tree keys per request
            head_size=head_size,  # Dh
            groups=groups,  # Hq / Hkv
            block_size=key_cache.shape[1],  # slots per cache block
            scale=scale,  # softmax scale
            keys_per_split=keys_per_split,  # keys one split walks (a multiple of BLOCK_N)
            HAS_ROW_VALID=row_valid is not None,
            IEEE_DOT=query.dtype == torch.float32,
            NUM_SPLITS=num_splits,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_D=block_d,
        )
        if num_splits > 1:
            self._merge_grid = (num_reqs, num_queries, heads)
            # Every argument but the layer's output.
            self._merge = dict(
                part_out_ptr=part_out,  # [R, S, Tq, Hq, Dh] float32: per key split output
                part_lse_ptr=part_lse,  # [R, S, Tq, Hq] float32: per key split log-sum-exp
                query_rows_ptr=rows,  # [R, Tq] int64: flat row of tree query t of request r
                row_valid_ptr=valid,  # [R, Tq] int8: rows to compute (read if HAS_ROW_VALID)
                stride_pr=part_out_strides[0],
                stride_ps=part_out_strides[1],
                stride_pt=part_out_strides[2],
                stride_ph=part_out_strides[3],
                stride_lr=part_lse_strides[0],
                stride_ls=part_lse_strides[1],
                stride_lt=part_lse_strides[2],
                stride_ot=output.stride(0),
                stride_oh=output.stride(1),
                stride_qr=rows.stride(0),
                stride_rv=valid.stride(0) if valid is not None else 0,
                head_size=head_size,  # Dh
                HAS_ROW_VALID=row_valid is not None,
                NUM_SPLITS=num_splits,
                BLOCK_D=block_d,
            )

    def launch_tensors(self) -> list[torch.Tensor]:
        """The tensors every layer's launch reads besides its own query, caches and output."""
        if self.num_reqs == 0:
            return []
        merge = self._merge.values() if self.num_splits > 1 else ()
        found = [v for v in (*self._launch.values(), *merge) if isinstance(v, torch.Tensor)]
        return list({id(t): t for t in found}.values())

    def __call__(
        self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, output: torch.Tensor
    ) -> None:
        """One layer: its query [tokens, Hq, Dh], key/value caches and output, shaped
        and strided as the tensors this was prepared with."""
        if self.num_reqs == 0:
            return
        _paged_tree_attention_kernel[self._grid](
            q_ptr=query,  # [T, Hq, Dh] the forward's queries (Dh contiguous)
            k_ptr=key_cache,  # [num_blocks, block_size, Hkv, Dh] key cache, any strides
            v_ptr=value_cache,  # [num_blocks, block_size, Hkv, Dh] value cache, any strides
            out_ptr=output,  # [T, Hq, Dh] output (Dh contiguous); only tree rows are written
            **self._launch,
        )
        if self.num_splits > 1:
            _merge_splits_kernel[self._merge_grid](out_ptr=output, **self._merge)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr,  # [R, S, Tq, Hq, Dh] float32: per key split output (read if NUM_SPLITS > 1)
    part_lse_ptr,  # [R, S, Tq, Hq] float32: per key split log-sum-exp (read if NUM_SPLITS > 1)
    out_ptr,  # [T, Hq, Dh] output (Dh contiguous): the merged tree rows
    query_rows_ptr,  # [R, Tq] int64: flat row of tree query t of request r
    row_valid_ptr,  # [R, Tq] int8: rows to compute (read if HAS_ROW_VALID)
    stride_pr,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_lr,
    stride_ls,
    stride_lt,
    stride_ot,
    stride_oh,
    stride_qr,
    stride_rv,
    head_size,  # Dh
    HAS_ROW_VALID: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One (request, tree query, head): the splits' partial results merged by
    log-sum-exp, out = sum_s exp(lse_s - lse) out_s, written at the query's row;
    rows that are not valid are left untouched (no host-side compaction)."""
    req = tl.program_id(0)
    t = tl.program_id(1)
    head = tl.program_id(2)
    d = tl.arange(0, BLOCK_D)
    keep = d < head_size
    if HAS_ROW_VALID:
        keep = keep & (tl.load(row_valid_ptr + req * stride_rv + t + d * 0) != 0)
    lse_base = part_lse_ptr + req * stride_lr + t * stride_lt + head
    out_base = part_out_ptr + req * stride_pr + t * stride_pt + head * stride_ph + d
    top = tl.load(lse_base)
    for split in tl.static_range(1, NUM_SPLITS):
        top = tl.maximum(top, tl.load(lse_base + split * stride_ls))
    total = tl.zeros([BLOCK_D], dtype=tl.float32)
    weight_sum = 0.0
    for split in tl.static_range(NUM_SPLITS):
        lse = tl.load(lse_base + split * stride_ls)
        weight = tl.where(lse > float("-inf"), tl.exp(lse - top), 0.0)  # a split that saw no key: 0
        total += weight * tl.load(out_base + split * stride_ps, mask=keep, other=0.0)
        weight_sum += weight
    row = tl.load(query_rows_ptr + req * stride_qr + t)
    out = total / weight_sum  # every row sees a key in some split: weight_sum >= 1
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=keep)


def _num_splits(device: torch.device, programs: int, max_context_len: int | None) -> int:
    """Key splits so that few requests over long contexts still fill the GPU:
    about two programs per multiprocessor, at least 256 keys per split, at most 16."""
    if device.type != "cuda" or max_context_len is None:
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = triton.cdiv(2 * sms, max(programs, 1))
    return int(max(1, min(16, wanted, max_context_len // 256)))
