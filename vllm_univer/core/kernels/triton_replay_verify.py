"""Triton kernel: the node rules of rrs, rrsw and traversal (a node's run of
rejections), one launch per depth level (the CUDA path of ``verify``).

The PyTorch rules (``verifiers/rrs.py``, ``traversal.py`` over
``rejection_replay.RejectionReplay``) issue 1100-2000 small ATen ops for a 2x5
tree, each a kernel launch on CUDA. Here one program per (request, node of the
level) runs the node's rejections over its child slots j = 0, 1, ...:

    at the child   R_j(x_j), Q_j(x_j) replayed on the child tokens (O(C^2))
    rule           rrs / rrsw: alpha_j = min(1, (R_j(x_j) / M) / (Q_j(x_j) / N))
                   traversal:  P~ of the child = min(1, P~ (R_j(x_j) / M) / (Q_j(x_j) / N))
    reject x_j     a_j = 1 (rrs, rrsw) or P~ (traversal), c_j = M / N
    one pass       M, N = sum R_{j+1}, sum Q_{j+1} (the rows replayed per
                   vocabulary block, float64); traversal: P~ <- h(M' / M, P~)

with M = N = 1 before the first rejection (the rows are distributions), the
same formulas as the PyTorch rules, and writes each child's weight (alpha, or
P~ on entry), traversal's h = the final P~, and the steps' a_j, c_j: the end
node's residual row R_C is replayed from them by ``triton_finish_step``.

Where a level has too few nodes to fill the GPU (one request), each node's
vocabulary is split in slices across programs (``triton_rows.vocab_slices``):
the level takes one launch per pass, each program adding up its slice's masses
after that rejection (the node's state before it rebuilt from the earlier
passes' slice sums, added in a fixed order), and one more for the rule's outputs.

Tensors: p, q [B, N+1, V] (last dim contiguous; any float dtype); tokens
[B, N+1] int64 (-1: missing); children [N+1, C] int64 (-1 padded); steps
[B, N+1, 2C] float64 (a_0..a_{C-1}, then c_0..c_{C-1}).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import expect, expect_tree_rows
from .triton_rows import (
    block_size,
    child_slots,
    clipped_ratio,
    entry_scale,
    node_rows,
    replay_row,
    safe_ratio,
    slot_block,
    stop_prob,
    vocab_slices,
)

# Kernel-visible constants must be tl.constexpr (compiled Triton rejects plain globals; the
# interpreter does not); host code passes their ``.value``.
RRS, RRSW, TRAVERSAL = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
RULES = {"rrs": RRS.value, "rrsw": RRSW.value, "traversal": TRAVERSAL.value}
# How a program gets the masses after each rejection: one pass over the whole rows
# (WHOLE); its slice of pass ``pass_index``, the earlier passes from their slice sums
# (SPLIT_PASS); every pass from its slice sums, then the outputs (SPLIT_FINISH).
WHOLE, SPLIT_PASS, SPLIT_FINISH = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _replayed_masses(
    p_row, q_row, tok, slot, a_vec, c_vec, steps, lo, hi, REMOVES: tl.constexpr, BLOCK_V: tl.constexpr
):
    # (sum R, sum Q) over the tokens [lo, hi) after the first ``steps`` rejections (float64).
    offs = tl.arange(0, BLOCK_V)
    r_acc = tl.zeros([BLOCK_V], dtype=tl.float64)
    q_acc = tl.zeros([BLOCK_V], dtype=tl.float64)
    for start in range(lo, hi, BLOCK_V):
        idx = start + offs
        inside = idx < hi
        p_blk = tl.load(p_row + idx, mask=inside, other=0.0).to(tl.float64)
        q_blk = tl.load(q_row + idx, mask=inside, other=0.0).to(tl.float64)
        r_blk, q_kept = replay_row(p_blk, q_blk, idx, tok, slot, a_vec, c_vec, steps, REMOVES)
        r_acc += r_blk
        q_acc += q_kept
    return tl.sum(r_acc, axis=0), tl.sum(q_acc, axis=0)


@triton.jit
def _replay_node(
    p_row,
    q_row,
    tok,
    slot,
    scale,
    parts,  # this (request, node)'s slice sums [J, 2, S] float64 (SPLIT_PASS, SPLIT_FINISH)
    num_slots,
    vocab,
    lo,
    hi,
    pass_index,
    num_splits,
    RULE: tl.constexpr,
    REMOVES: tl.constexpr,
    MASSES_AFTER_LAST: tl.constexpr,
    MODE: tl.constexpr,
    SLOTS: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """The node's run of rejections over its child slots (module docstring) ->
    (the children's weights, a_vec, c_vec [SLOTS], the final P~ (traversal's h));
    the masses after each rejection by ``MODE``."""
    has_tok = tok >= 0
    p_tok = tl.load(p_row + tl.maximum(tok, 0), mask=has_tok, other=0.0).to(tl.float64)
    q_tok = tl.load(q_row + tl.maximum(tok, 0), mask=has_tok, other=0.0).to(tl.float64)
    p_mass = tl.full((), 1.0, tl.float64)
    q_mass = tl.full((), 1.0, tl.float64)
    a_vec = tl.full([SLOTS], 1.0, tl.float64)
    c_vec = tl.zeros([SLOTS], dtype=tl.float64)
    child = tl.zeros([SLOTS], dtype=tl.float64)
    split = tl.arange(0, SPLITS)
    for j in range(0, num_slots):
        at_slot = slot == j
        exists = tl.sum(tl.where(at_slot, tok, 0), axis=0) >= 0
        r_at, q_at = replay_row(p_tok, q_tok, tok, tok, slot, a_vec, c_vec, j, REMOVES)
        r_x = tl.sum(tl.where(at_slot, r_at, 0.0), axis=0)
        q_x = tl.sum(tl.where(at_slot, q_at, 0.0), axis=0)
        p_safe = tl.where(p_mass > 0, p_mass, 1.0)
        q_safe = tl.where(q_mass > 0, q_mass, 1.0)
        weight = clipped_ratio(scale * r_x / p_safe, q_x / q_safe)
        child = tl.where(at_slot & exists, weight, child)
        a_vec = tl.where(at_slot & exists, scale, a_vec)
        c_vec = tl.where(at_slot & exists, safe_ratio(p_mass, q_mass), c_vec)
        if j + 1 < num_slots + MASSES_AFTER_LAST:  # the masses after rejecting x_j
            if MODE == WHOLE:
                new_p_mass, new_q_mass = _replayed_masses(
                    p_row, q_row, tok, slot, a_vec, c_vec, j + 1, 0, vocab, REMOVES, BLOCK_V
                )
            else:
                if MODE == SPLIT_PASS:
                    if j == pass_index:  # this program's slice of this pass; later passes are not its
                        slice_p, slice_q = _replayed_masses(
                            p_row, q_row, tok, slot, a_vec, c_vec, j + 1, lo, hi, REMOVES, BLOCK_V
                        )
                        at = parts + 2 * j * num_splits + tl.program_id(2)
                        tl.store(at, slice_p)
                        tl.store(at + num_splits, slice_q)
                keep = split < num_splits * (j < pass_index)  # the passes done (all in SPLIT_FINISH)
                new_p_mass = tl.sum(tl.load(parts + 2 * j * num_splits + split, mask=keep, other=0.0), axis=0)
                new_q_mass = tl.sum(tl.load(parts + (2 * j + 1) * num_splits + split, mask=keep, other=0.0), axis=0)
            if RULE == TRAVERSAL:
                # A missing child was never visited: the node's state stays.
                scale = tl.where(exists, stop_prob(new_p_mass / p_safe, scale), scale)
                p_mass = tl.where(exists, new_p_mass, p_mass)
                q_mass = tl.where(exists, new_q_mass, q_mass)
            else:
                p_mass = new_p_mass
                if REMOVES:
                    q_mass = new_q_mass
    return child, a_vec, c_vec, scale


@triton.jit
def _store_rule(
    weight_ptr,
    stop_ptr,
    steps_ptr,
    b,
    node,
    kid,
    slot,
    child,
    a_vec,
    c_vec,
    scale,
    stride_wb,
    stride_sb,
    stride_sn,
    num_slots,
    RULE: tl.constexpr,
):
    # Children's weights, traversal's h and the steps' a_j, c_j.
    tl.store(weight_ptr + b * stride_wb + kid, child.to(weight_ptr.dtype.element_ty), mask=kid >= 0)
    if RULE == TRAVERSAL:
        tl.store(stop_ptr + b * stride_wb + node, scale.to(stop_ptr.dtype.element_ty))
    steps_row = steps_ptr + b * stride_sb + node * stride_sn
    tl.store(steps_row + slot, a_vec, mask=slot < num_slots)
    tl.store(steps_row + num_slots + slot, c_vec, mask=slot < num_slots)


@triton.jit
def _replay_level_kernel(
    p_ptr,  # [B, N+1, V] target rows p (any float dtype, V contiguous)
    q_ptr,  # [B, N+1, V] draft rows q: what each node's children were drawn from
    tokens_ptr,  # [B, N+1] int64 draft tokens (-1: the node does not exist)
    nodes_ptr,  # [n] int64: the level's node ids
    children_ptr,  # [N+1, C] int64: each node's children in slot order, -1 padded
    weight_ptr,  # [B, N+1] work dtype: read (traversal: P~ of the node), written (children)
    stop_ptr,  # [B, N+1] work dtype, written (traversal): h of the node
    steps_ptr,  # [B, N+1, 2C] float64, written: a_j, then c_j
    parts_ptr,  # [B, n, J, 2, S] float64: slice sums of each pass (split modes)
    stride_pb,
    stride_pn,
    stride_qb,
    stride_qn,
    stride_tb,
    stride_cn,
    stride_wb,
    stride_sb,
    stride_sn,
    stride_xb,
    stride_xn,
    vocab,  # V
    num_slots,  # C: child slots per node
    chunk,  # vocabulary entries per slice
    pass_index,  # which rejection pass a SPLIT_PASS launch sums
    num_splits,  # S: vocabulary slices per node
    RULE: tl.constexpr,
    REMOVES: tl.constexpr,  # a rejected token leaves Q (rrsw, traversal)
    MASSES_AFTER_LAST: tl.constexpr,  # 1: the masses after the last slot too (traversal's h)
    MODE: tl.constexpr,
    SLOTS: tl.constexpr,  # num_slots rounded up to a power of 2
    SPLITS: tl.constexpr,  # num_splits rounded up to a power of 2
    BLOCK_V: tl.constexpr,
):
    # One program per (request, node of the level), and per vocabulary slice in SPLIT_PASS.
    b, i = tl.program_id(0), tl.program_id(1)
    node = tl.load(nodes_ptr + i)
    p_row, q_row = node_rows(p_ptr, q_ptr, b, node, stride_pb, stride_pn, stride_qb, stride_qn)
    slot, kid, tok = child_slots(children_ptr, tokens_ptr, b, node, stride_tb, stride_cn, num_slots, SLOTS)
    scale = entry_scale(weight_ptr, b, stride_wb, node, RULE == TRAVERSAL)
    lo = tl.program_id(2) * chunk
    child, a_vec, c_vec, scale = _replay_node(
        p_row,
        q_row,
        tok,
        slot,
        scale,
        parts_ptr + b * stride_xb + i * stride_xn,
        num_slots,
        vocab,
        lo,
        tl.minimum(lo + chunk, vocab),
        pass_index,
        num_splits,
        RULE,
        REMOVES,
        MASSES_AFTER_LAST,
        MODE,
        SLOTS,
        SPLITS,
        BLOCK_V,
    )
    if MODE != SPLIT_PASS:
        _store_rule(
            weight_ptr,
            stop_ptr,
            steps_ptr,
            b,
            node,
            kid,
            slot,
            child,
            a_vec,
            c_vec,
            scale,
            stride_wb,
            stride_sb,
            stride_sn,
            num_slots,
            RULE,
        )


def replay_level(
    rule: str,
    p: torch.Tensor,
    q: torch.Tensor,
    tokens: torch.Tensor,
    nodes: torch.Tensor,
    children: torch.Tensor,
    weight: torch.Tensor,
    stop: torch.Tensor,
    steps: torch.Tensor,
) -> None:
    """The node rule at ``nodes`` [n] (one depth level) of every request, in place:
    children's weights into ``weight`` [B, N+1], h into ``stop`` (traversal) and
    the rejections' a_j, c_j into ``steps`` [B, N+1, 2C] float64. One launch, or
    one per pass and one more where the vocabulary is split (``vocab_slices``)."""
    batch, n1, vocab = expect_tree_rows(p, q, tokens)
    expect("nodes", nodes, (None,), torch.int64)
    expect("children", children, (n1, None), torch.int64)
    expect("weight", weight, (batch, n1))
    expect("stop", stop, (batch, n1))
    expect("steps", steps, (batch, n1, 2 * children.shape[1]), torch.float64)
    num_nodes, num_slots = nodes.numel(), children.shape[1]
    masses_after_last = int(rule == "traversal")
    passes = num_slots - 1 + masses_after_last
    if passes > 0:
        splits, chunk, block_v = vocab_slices(p.device, batch * num_nodes, vocab)
    else:  # one child slot and no h: no pass over the rows to split
        splits, chunk, block_v = 1, vocab, block_size(vocab)
    if splits == 1:
        parts = steps  # stands in for the split modes' slice sums, which one split never reads
    else:
        parts = torch.empty(batch, num_nodes, passes, 2, splits, dtype=torch.float64, device=p.device)
    # What every launch of this level shares; each launch adds its pass, split count and mode.
    level = dict(
        p_ptr=p,  # [B, N+1, V] target rows p (any float dtype, V contiguous)
        q_ptr=q,  # [B, N+1, V] draft rows q: what each node's children were drawn from
        tokens_ptr=tokens,  # [B, N+1] int64 draft tokens (-1: the node does not exist)
        nodes_ptr=nodes,  # [n] int64: the level's node ids
        children_ptr=children,  # [N+1, C] int64: each node's children in slot order, -1 padded
        weight_ptr=weight,  # [B, N+1] work dtype: read (traversal: P~ of the node), written (children)
        stop_ptr=stop,  # [B, N+1] work dtype, written (traversal): h of the node
        steps_ptr=steps,  # [B, N+1, 2C] float64, written: a_j, then c_j
        parts_ptr=parts,  # [B, n, J, 2, S] float64: slice sums of each pass (split modes)
        stride_pb=p.stride(0),
        stride_pn=p.stride(1),
        stride_qb=q.stride(0),
        stride_qn=q.stride(1),
        stride_tb=tokens.stride(0),
        stride_cn=children.stride(0),
        stride_wb=weight.stride(0),
        stride_sb=steps.stride(0),
        stride_sn=steps.stride(1),
        stride_xb=parts.stride(0),
        stride_xn=parts.stride(1),
        vocab=vocab,  # V
        num_slots=num_slots,  # C: child slots per node
        chunk=chunk,  # vocabulary entries per slice
        RULE=RULES[rule],
        REMOVES=rule != "rrs",  # a rejected token leaves Q (rrsw, traversal)
        MASSES_AFTER_LAST=masses_after_last,  # 1: the masses after the last slot too (traversal's h)
        SLOTS=slot_block(num_slots),  # num_slots rounded up to a power of 2
        SPLITS=triton.next_power_of_2(splits),  # num_splits rounded up to a power of 2
        BLOCK_V=block_v,
    )
    if splits == 1:
        _replay_level_kernel[(batch, num_nodes, 1)](**level, pass_index=0, num_splits=1, MODE=WHOLE.value)
        return
    for pass_index in range(passes):
        _replay_level_kernel[(batch, num_nodes, splits)](
            **level, pass_index=pass_index, num_splits=splits, MODE=SPLIT_PASS.value
        )
    _replay_level_kernel[(batch, num_nodes, 1)](**level, pass_index=passes, num_splits=splits, MODE=SPLIT_FINISH.value)
