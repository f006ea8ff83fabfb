"""Triton kernel: the drafter's inputs of one step moved by each request's shift,
in one launch (the CUDA path of ``draft_inputs.place_draft_inputs``).

``build_draft_step_inputs`` lays every draft forward's inputs out on the host as
if the verification had accepted nothing, and the device moves them by each
request's shift s = clamp(min(new tokens - 1, bound), 0) once the verification
has run. In PyTorch that is ~25 small ops per step (each a launch on CUDA:
gathers of the shift per row, the slot lookup in the block table, level 0's
tokens picked from the committed or the new ones). Here one program per block
of indices writes, for index i:

    rows i < T          position + s, slot of (slot position + s) in the block table
    rows i < num0       level 0's token: the new token at rel + s if rel + s >= 0,
                        else the committed one s host rows on (-1 read as 0)
    entries i < S       keys seen + s (int32)
    requests i < R      the root's token (its level-0 row's, as above), committed + s

Tensors (all on one device, contiguous): ``draft_inputs.HostLayout``'s fields,
new_tokens [R, W] int64 (-1 padded), new_counts [R] int32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 128


@triton.jit
def _shift(counts_ptr, bound_ptr, req, mask):
    """int64: a request's shift, its new tokens but one, clamped to [0, bound]."""
    count = tl.load(counts_ptr + req, mask=mask, other=1)
    bound = tl.load(bound_ptr + req, mask=mask, other=0)
    return tl.maximum(tl.minimum(count - 1, bound), 0).to(tl.int64)


@triton.jit
def _level0_token(row, shift, tokens_ptr, neg_rel_ptr, new_index_ptr, new_ptr, mask):
    """Level 0's token of ``row`` under ``shift``: loads only the side it takes
    (the other side's index may lie outside its tensor)."""
    neg_rel = tl.load(neg_rel_ptr + row, mask=mask, other=0)
    use_new = shift >= neg_rel
    new_at = tl.load(new_index_ptr + row, mask=mask, other=0) + shift
    new = tl.load(new_ptr + new_at, mask=mask & use_new, other=0)
    old = tl.load(tokens_ptr + row + shift, mask=mask & (shift < neg_rel), other=0)
    return tl.maximum(tl.where(use_new, new, old), 0)


@triton.jit
def _place_kernel(
    counts_ptr,  # [R] int32: new tokens per request
    bound_ptr,  # [R] int32: the host's bound on each shift
    new_ptr,  # [R * W] int64: the new tokens, -1 padded
    rows_ptr,  # [T] int64: each row's request (level 0's rows first)
    row_base_ptr,  # [T] int64: its request's offset in the flat block table
    pos_ptr,  # [T] int64: RoPE positions before the shift
    slot_pos_ptr,  # [T] int64: cache positions before the shift
    table_ptr,  # [R * blocks] int64: block table
    seq_rows_ptr,  # [S] int64: each entry's request
    seq_ptr,  # [S] int32: keys seen before the shift
    tokens_ptr,  # [num0 + pad] int64: level 0's committed tokens before the shift
    neg_rel_ptr,  # [num0] int64: committed - position of each level-0 row
    new_index_ptr,  # [num0] int64: index into new_ptr at shift 0 (used only where it lands)
    root_rows_ptr,  # [R] int64: each root's level-0 row
    committed_ptr,  # [R] int64
    out_pos_ptr,  # [T] int64
    out_slot_ptr,  # [T] int64
    out_seq_ptr,  # [S] int32
    out_tokens_ptr,  # [num0] int64
    out_root_ptr,  # [R] int64
    out_context_ptr,  # [R] int64
    num_rows,
    num_seq,
    num0,
    num_reqs,
    block_size,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)

    rows = i < num_rows
    req = tl.load(rows_ptr + i, mask=rows, other=0)
    shift = _shift(counts_ptr, bound_ptr, req, rows)
    slot_pos = tl.load(slot_pos_ptr + i, mask=rows, other=0) + shift
    base = tl.load(row_base_ptr + i, mask=rows, other=0)
    block = tl.load(table_ptr + base + slot_pos // block_size, mask=rows, other=0)
    tl.store(out_pos_ptr + i, tl.load(pos_ptr + i, mask=rows, other=0) + shift, mask=rows)
    tl.store(out_slot_ptr + i, block * block_size + slot_pos % block_size, mask=rows)
    level0 = i < num0
    token = _level0_token(i, shift, tokens_ptr, neg_rel_ptr, new_index_ptr, new_ptr, level0)
    tl.store(out_tokens_ptr + i, token, mask=level0)

    entries = i < num_seq
    seq_shift = _shift(counts_ptr, bound_ptr, tl.load(seq_rows_ptr + i, mask=entries, other=0), entries)
    seq = tl.load(seq_ptr + i, mask=entries, other=0) + seq_shift
    tl.store(out_seq_ptr + i, seq.to(tl.int32), mask=entries)

    reqs = i < num_reqs
    root_shift = _shift(counts_ptr, bound_ptr, i, reqs)
    root_row = tl.load(root_rows_ptr + i, mask=reqs, other=0)
    root = _level0_token(root_row, root_shift, tokens_ptr, neg_rel_ptr, new_index_ptr, new_ptr, reqs)
    tl.store(out_root_ptr + i, root, mask=reqs)
    tl.store(out_context_ptr + i, tl.load(committed_ptr + i, mask=reqs, other=0) + root_shift, mask=reqs)


def place_draft_inputs_fused(layout, new_tokens: torch.Tensor, new_counts: torch.Tensor, block_size: int):
    """``draft_inputs.place_draft_inputs`` in one launch: layout a ``HostLayout``
    (on the device), new_tokens [R, W] int64, new_counts [R] int32 ->
    ``PlacedInputs``. Two allocations (int64 and int32), sliced."""
    from .draft_inputs import PlacedInputs

    num_rows, num_seq = layout.rows.numel(), layout.seq_rows.numel()
    num0, num_reqs = layout.neg_rel.numel(), layout.committed.numel()
    wide = torch.empty(2 * num_rows + num0 + 2 * num_reqs, dtype=torch.int64, device=layout.rows.device)
    seq = torch.empty(num_seq, dtype=torch.int32, device=layout.rows.device)
    pos, slots, tokens, roots, context = wide.split([num_rows, num_rows, num0, num_reqs, num_reqs])
    grid = (triton.cdiv(max(num_rows, num_seq, num_reqs, 1), BLOCK),)
    _place_kernel[grid](
        new_counts,
        layout.bound,
        new_tokens.contiguous(),
        layout.rows,
        layout.row_base,
        layout.positions,
        layout.slot_positions,
        layout.table,
        layout.seq_rows,
        layout.seq_lens,
        layout.tokens,
        layout.neg_rel,
        layout.new_index,
        layout.root_rows,
        layout.committed,
        pos,
        slots,
        seq,
        tokens,
        roots,
        context,
        num_rows,
        num_seq,
        num0,
        num_reqs,
        block_size,
        BLOCK=BLOCK,
    )
    return PlacedInputs(pos, slots, seq, tokens, roots, context)
