"""Triton kernel: the node rules of the ``topk1`` verifiers (univer, greedy) and
of target_only, one launch per depth level (the CUDA path of ``verify``).

The PyTorch node rules (``verifiers/univer.py``, ``greedy.py``,
``target_only.py``) issue ~100 small ATen ops per level, each a kernel launch on
CUDA: a 2x5 tree took 5.4 ms per ``verify`` on an H200 whatever the batch.
Here one program per (request, node of the level) reads the node's p and q rows
and does the whole rule:

    pass 1   sum p, sum q                                   (target_only: sum p)
    pass 2   F' = sum_y min(q(y), P~ q(off T) p(y))          (univer, greedy)
    then     the rule's O(C) arithmetic on the child slots, exactly as the
             PyTorch rule writes it (same formulas, float64 accumulation),

and writes each child's weight (P~ for univer, alpha for the DESCENT rules),
the node's stop probability h (univer) and the factor 1 / q(off T) that turns q
into q_bar (0 when the node has no sampled child) for the residual draw.

Where a level has too few nodes to fill the GPU (one request: a single program
streams the root's 152k-token rows twice), the vocabulary is split: a level
then takes three launches, each program on one slice of one node's rows:

    sums     partial sum p, sum q per slice
    min      partial F' per slice (from the node's total sums and entry scale)
    finish   the slices' partials added in a fixed order, then the O(C) rule

with the same formulas (only the order of the float64 additions differs).
``triton_rows.vocab_slices`` picks the slices per level from the device's
multiprocessor count; ``VLLM_UNIVER_VERIFY_SPLITS`` forces a count (1: never split).

The rest of the step is ``triton_finish_step``.

Tensors: p, q [B, N+1, V] (last dim contiguous; float32, bfloat16 or float64);
tokens [B, N+1] int64 (-1: missing); children [N+1, C] int64 (-1 padded).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import children_strides, expect, expect_tree_rows
from .triton_rows import (
    child_slots,
    clipped_ratio,
    entry_scale,
    node_rows,
    slot_block,
    stop_prob,
    vocab_slices,
)

# Kernel-visible constants must be tl.constexpr (compiled Triton rejects plain globals; the
# interpreter does not); host code passes their ``.value``.
UNIVER, GREEDY, TARGET_ONLY = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
RULES = {"univer": UNIVER.value, "greedy": GREEDY.value, "target_only": TARGET_ONLY.value}


@triton.jit
def _row_sums(p_row, q_row, lo, hi, WITH_Q: tl.constexpr, BLOCK_V: tl.constexpr):
    # (sum p, sum q) over the tokens [lo, hi) in float64 (sum q = 0 without WITH_Q).
    offs = tl.arange(0, BLOCK_V)
    p_acc = tl.zeros([BLOCK_V], dtype=tl.float64)
    q_acc = tl.zeros([BLOCK_V], dtype=tl.float64)
    for start in range(lo, hi, BLOCK_V):
        inside = start + offs < hi
        p_acc += tl.load(p_row + start + offs, mask=inside, other=0.0).to(tl.float64)
        if WITH_Q:
            q_acc += tl.load(q_row + start + offs, mask=inside, other=0.0).to(tl.float64)
    return tl.sum(p_acc, axis=0), tl.sum(q_acc, axis=0)


@triton.jit
def _min_sum(p_row, q_row, factor, lo, hi, BLOCK_V: tl.constexpr):
    # sum_y min(q(y), factor p(y)) over the tokens [lo, hi) in float64.
    offs = tl.arange(0, BLOCK_V)
    full = tl.zeros([BLOCK_V], dtype=tl.float64)
    for start in range(lo, hi, BLOCK_V):
        inside = start + offs < hi
        p_blk = tl.load(p_row + start + offs, mask=inside, other=0.0).to(tl.float64)
        q_blk = tl.load(q_row + start + offs, mask=inside, other=0.0).to(tl.float64)
        full += tl.minimum(q_blk, p_blk * factor)
    return tl.sum(full, axis=0)


@triton.jit
def _node_scale(weight_ptr, b, stride_wb, node, RULE: tl.constexpr):
    # P~ on entry to the node for univer (written by the level above), 1 for greedy / target_only.
    return entry_scale(weight_ptr, b, stride_wb, node, RULE == UNIVER)


@triton.jit
def _sampled_child(q_row, q_sum, scale, slot, tok):
    """Topk1Node.read: slot 0 the sampled child r ~ q_bar, slots 1.. the top set T ->
    (q at the child tokens, on_top, q(off T) (1 without a sampled child), has_sampled,
    the factor ``scale`` q(off T) of F', ``scale`` the node's entry scale P~)."""
    has_tok = tok >= 0
    q_tok = tl.load(q_row + tl.maximum(tok, 0), mask=has_tok, other=0.0).to(tl.float64)
    on_top = has_tok & (slot >= 1)
    q_off = q_sum - tl.sum(tl.where(on_top, q_tok, 0.0), axis=0)
    r_tok = tl.sum(tl.where(slot == 0, tok, 0), axis=0)
    has_sampled = (r_tok >= 0) & (q_off > 0)
    q_off = tl.where(has_sampled, q_off, 1.0)
    return q_tok, on_top, q_off, has_sampled, scale * q_off


@triton.jit
def _node_rule(
    p_row,
    q_row,
    weight_ptr,
    stop_ptr,
    q_bar_scale_ptr,
    b,
    stride_wb,
    node,
    slot,
    kid,
    tok,
    scale,
    p_sum,
    q_sum,
    full,
    RULE: tl.constexpr,
):
    """The rule's O(C) arithmetic on the node's child slots, from its entry scale
    ``scale`` (``_node_scale``), its row sums and
    ``full`` = sum_y min(q(y), P~ q(off T) p(y)) (unused by target_only), exactly
    as the PyTorch rule writes it: writes the children's weights, h (univer) and
    1 / q(off T) (0 without a sampled child)."""
    has_tok = tok >= 0
    p_tok = tl.load(p_row + tl.maximum(tok, 0), mask=has_tok, other=0.0).to(tl.float64)
    if RULE == TARGET_ONLY:
        # alpha_j = p(x_j) / (sum p - p of the distinct earlier tokens); a repeat gets 0.
        earlier = (tok[:, None] == tok[None, :]) & (slot[None, :] < slot[:, None])
        first = has_tok & (tl.max(earlier.to(tl.int32), axis=1) == 0)
        mass = tl.where(first, p_tok, 0.0)
        child = clipped_ratio(mass, tl.maximum(p_sum - (tl.cumsum(mass, axis=0) - mass), 0.0))
    else:
        q_tok, on_top, q_off, has_sampled, factor = _sampled_child(q_row, q_sum, scale, slot, tok)
        p_r = tl.sum(tl.where(slot == 0, p_tok, 0.0), axis=0)
        q_r = tl.sum(tl.where(slot == 0, q_tok, 0.0), axis=0)
        # F = sum_{y not in T} min(q_bar(y), scale p(y)) = (sum_y min(q, scale q_off p) - on T) / q_off
        top_min = tl.sum(tl.where(on_top, tl.minimum(q_tok, p_tok * factor), 0.0), axis=0)
        carried = tl.maximum((full - top_min) / q_off, 0.0)
        carried = tl.where(has_sampled, carried, 0.0)
        q_bar_r = tl.where(has_sampled, q_r / q_off, 0.0)
        p_top = tl.where(on_top, p_tok, 0.0)
        if RULE == UNIVER:
            top_mass = scale * p_top
            rho = tl.maximum(scale * (p_sum - tl.sum(p_top, axis=0)) - carried, 0.0)
            stop = stop_prob(rho, scale)
            tl.store(stop_ptr + b * stride_wb + node, stop.to(stop_ptr.dtype.element_ty))
            room = tl.maximum(1.0 - carried - (tl.cumsum(top_mass, axis=0) - top_mass), 0.0)
            child = tl.where(slot == 0, clipped_ratio(scale * p_r, q_bar_r), clipped_ratio(top_mass, room))
        else:  # GREEDY
            g_total = p_sum - carried
            room = tl.maximum(g_total - (tl.cumsum(p_top, axis=0) - p_top), 0.0)
            child = tl.where(slot == 0, clipped_ratio(p_r, q_bar_r), clipped_ratio(p_top, room))
        q_bar_scale = tl.where(has_sampled, 1.0 / q_off, 0.0)
        tl.store(q_bar_scale_ptr + b * stride_wb + node, q_bar_scale)
    child = tl.where(has_tok, child, 0.0)
    tl.store(weight_ptr + b * stride_wb + kid, child.to(weight_ptr.dtype.element_ty), mask=kid >= 0)


@triton.jit
def _topk1_level_kernel(
    p_ptr,  # [B, N+1, V] target rows p (any float dtype, V contiguous)
    q_ptr,  # [B, N+1, V] draft rows q: what each node's children were drawn from
    tokens_ptr,  # [B, N+1] int64 draft tokens (-1: the node does not exist)
    nodes_ptr,  # [n] int64: the level's node ids
    children_ptr,  # [N+1, C] int64: each node's children in slot order, -1 padded
    weight_ptr,  # [B, N+1] work dtype: read (univer: P~ of the node), written (children)
    stop_ptr,  # [B, N+1] work dtype: h of the node (univer)
    q_bar_scale_ptr,  # [B, N+1] float64: 1 / q(off T), 0 without a sampled child
    stride_pb,
    stride_pn,
    stride_qb,
    stride_qn,
    stride_tb,
    stride_cb,  # 0: one tree for the batch; else each request's own children
    stride_cn,
    stride_wb,
    vocab,  # V
    num_slots,  # C: child slots per node
    RULE: tl.constexpr,
    SLOTS: tl.constexpr,  # num_slots rounded up to a power of 2
    BLOCK_V: tl.constexpr,
):
    # One program per (request, node): both passes over the whole rows, then the rule.
    b = tl.program_id(0)
    node = tl.load(nodes_ptr + tl.program_id(1))
    p_row, q_row = node_rows(p_ptr, q_ptr, b, node, stride_pb, stride_pn, stride_qb, stride_qn)
    slot, kid, tok = child_slots(
        children_ptr + b * stride_cb, tokens_ptr, b, node, stride_tb, stride_cn, num_slots, SLOTS
    )
    p_sum, q_sum = _row_sums(p_row, q_row, 0, vocab, RULE != TARGET_ONLY, BLOCK_V)
    scale = _node_scale(weight_ptr, b, stride_wb, node, RULE)
    full = tl.zeros((), dtype=tl.float64)
    if RULE != TARGET_ONLY:
        _, _, _, _, factor = _sampled_child(q_row, q_sum, scale, slot, tok)
        full = _min_sum(p_row, q_row, factor, 0, vocab, BLOCK_V)
    _node_rule(
        p_row,
        q_row,
        weight_ptr,
        stop_ptr,
        q_bar_scale_ptr,
        b,
        stride_wb,
        node,
        slot,
        kid,
        tok,
        scale,
        p_sum,
        q_sum,
        full,
        RULE,
    )


@triton.jit
def _topk1_split_sums_kernel(
    p_ptr,  # [B, N+1, V] target rows p (any float dtype, V contiguous)
    q_ptr,  # [B, N+1, V] draft rows q: what each node's children were drawn from
    nodes_ptr,  # [n] int64: the level's node ids
    parts_ptr,  # [B, n, S, 3] float64: per slice sum p, sum q (and F' for the min kernel)
    stride_pb,
    stride_pn,
    stride_qb,
    stride_qn,
    stride_xb,
    stride_xn,
    vocab,  # V
    chunk,  # vocabulary entries per slice
    RULE: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # One program per (request, node of the level, vocabulary slice).
    b, i, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    node = tl.load(nodes_ptr + i)
    lo = s * chunk
    hi = tl.minimum(lo + chunk, vocab)
    p_row, q_row = node_rows(p_ptr, q_ptr, b, node, stride_pb, stride_pn, stride_qb, stride_qn)
    p_sum, q_sum = _row_sums(p_row, q_row, lo, hi, RULE != TARGET_ONLY, BLOCK_V)
    part = parts_ptr + b * stride_xb + i * stride_xn + s * 3
    tl.store(part, p_sum)
    tl.store(part + 1, q_sum)


@triton.jit
def _split_total(parts_ptr, b, i, column, stride_xb, stride_xn, num_splits, SPLITS: tl.constexpr):
    # One column of a node's slice partials (0: sum p, 1: sum q, 2: F') added in a fixed order.
    s = tl.arange(0, SPLITS)
    part = parts_ptr + b * stride_xb + i * stride_xn + s * 3 + column
    return tl.sum(tl.load(part, mask=s < num_splits, other=0.0), axis=0)


@triton.jit
def _topk1_split_min_kernel(
    p_ptr,  # [B, N+1, V] target rows p (any float dtype, V contiguous)
    q_ptr,  # [B, N+1, V] draft rows q: what each node's children were drawn from
    tokens_ptr,  # [B, N+1] int64 draft tokens (-1: the node does not exist)
    nodes_ptr,  # [n] int64: the level's node ids
    children_ptr,  # [N+1, C] int64: each node's children in slot order, -1 padded
    weight_ptr,  # [B, N+1] work dtype: read (univer: P~ of the node), written (children)
    parts_ptr,  # [B, n, S, 3] float64: per slice sum p, sum q, and F' for the finish kernel
    stride_pb,
    stride_pn,
    stride_qb,
    stride_qn,
    stride_tb,
    stride_cb,  # 0: one tree for the batch; else each request's own children
    stride_cn,
    stride_wb,
    stride_xb,
    stride_xn,
    vocab,  # V
    num_slots,  # C: child slots per node
    chunk,  # vocabulary entries per slice
    num_splits,  # S: vocabulary slices per node
    RULE: tl.constexpr,
    SLOTS: tl.constexpr,
    SPLITS: tl.constexpr,  # num_splits rounded up to a power of 2
    BLOCK_V: tl.constexpr,
):
    # One program per (request, node of the level, vocabulary slice): the slice's F'.
    b, i, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    node = tl.load(nodes_ptr + i)
    p_row, q_row = node_rows(p_ptr, q_ptr, b, node, stride_pb, stride_pn, stride_qb, stride_qn)
    slot, _, tok = child_slots(
        children_ptr + b * stride_cb, tokens_ptr, b, node, stride_tb, stride_cn, num_slots, SLOTS
    )
    # F' is not written yet: only sum q is read.
    q_sum = _split_total(parts_ptr, b, i, 1, stride_xb, stride_xn, num_splits, SPLITS)
    scale = _node_scale(weight_ptr, b, stride_wb, node, RULE)
    _, _, _, _, factor = _sampled_child(q_row, q_sum, scale, slot, tok)
    lo = s * chunk
    full = _min_sum(p_row, q_row, factor, lo, tl.minimum(lo + chunk, vocab), BLOCK_V)
    tl.store(parts_ptr + b * stride_xb + i * stride_xn + s * 3 + 2, full)


@triton.jit
def _topk1_split_finish_kernel(
    p_ptr,  # [B, N+1, V] target rows p (any float dtype, V contiguous)
    q_ptr,  # [B, N+1, V] draft rows q: what each node's children were drawn from
    tokens_ptr,  # [B, N+1] int64 draft tokens (-1: the node does not exist)
    nodes_ptr,  # [n] int64: the level's node ids
    children_ptr,  # [N+1, C] int64: each node's children in slot order, -1 padded
    weight_ptr,  # [B, N+1] work dtype: read (univer: P~ of the node), written (children)
    stop_ptr,  # [B, N+1] work dtype, written: h of the node (univer)
    q_bar_scale_ptr,  # [B, N+1] float64: 1 / q(off T), 0 without a sampled child
    parts_ptr,  # [B, n, S, 3] float64: per slice sum p, sum q, and F' for the finish kernel
    stride_pb,
    stride_pn,
    stride_qb,
    stride_qn,
    stride_tb,
    stride_cb,  # 0: one tree for the batch; else each request's own children
    stride_cn,
    stride_wb,
    stride_xb,
    stride_xn,
    num_slots,  # C: child slots per node
    num_splits,  # S: vocabulary slices per node
    RULE: tl.constexpr,
    SLOTS: tl.constexpr,
    SPLITS: tl.constexpr,
):
    # One program per (request, node of the level): the slices' partials, then the rule.
    b, i = tl.program_id(0), tl.program_id(1)
    node = tl.load(nodes_ptr + i)
    p_row, q_row = node_rows(p_ptr, q_ptr, b, node, stride_pb, stride_pn, stride_qb, stride_qn)
    slot, kid, tok = child_slots(
        children_ptr + b * stride_cb, tokens_ptr, b, node, stride_tb, stride_cn, num_slots, SLOTS
    )
    p_sum = _split_total(parts_ptr, b, i, 0, stride_xb, stride_xn, num_splits, SPLITS)
    q_sum = _split_total(parts_ptr, b, i, 1, stride_xb, stride_xn, num_splits, SPLITS)
    full = tl.zeros((), dtype=tl.float64)
    if RULE != TARGET_ONLY:
        full = _split_total(parts_ptr, b, i, 2, stride_xb, stride_xn, num_splits, SPLITS)
    _node_rule(
        p_row,
        q_row,
        weight_ptr,
        stop_ptr,
        q_bar_scale_ptr,
        b,
        stride_wb,
        node,
        slot,
        kid,
        tok,
        _node_scale(weight_ptr, b, stride_wb, node, RULE),
        p_sum,
        q_sum,
        full,
        RULE,
    )


def topk1_level(
    rule: str,
    p: torch.Tensor,
    q: torch.Tensor,
    tokens: torch.Tensor,
    nodes: torch.Tensor,
    children: torch.Tensor,
    weight: torch.Tensor,
    stop: torch.Tensor,
    q_bar_scale: torch.Tensor,
) -> None:
    """The node rule at ``nodes`` [n] (one depth level) of every request, in place:
    children's weights into ``weight`` [B, N+1], h into ``stop`` (univer) and
    1 / q(off T) into ``q_bar_scale`` [B, N+1] float64. One launch, or three where
    the vocabulary is split (``vocab_slices``)."""
    batch, n1, vocab = expect_tree_rows(p, q, tokens)
    expect("nodes", nodes, (None,), torch.int64)
    stride_cb, stride_cn = children_strides(children, batch, n1)
    expect("weight", weight, (batch, n1))
    expect("stop", stop, (batch, n1))
    expect("q_bar_scale", q_bar_scale, (batch, n1), torch.float64)
    num_nodes = nodes.numel()
    slots = slot_block(children.shape[-1])
    splits, chunk, block_v = vocab_slices(p.device, batch * num_nodes, vocab)
    if splits == 1:
        _topk1_level_kernel[(batch, num_nodes)](
            p_ptr=p,  # [B, N+1, V] target rows p (any float dtype, V contiguous)
            q_ptr=q,  # [B, N+1, V] draft rows q: what each node's children were drawn from
            tokens_ptr=tokens,  # [B, N+1] int64 draft tokens (-1: the node does not exist)
            nodes_ptr=nodes,  # [n] int64: the level's node ids
            children_ptr=children,  # [N+1, C] int64: each node's children in slot order, -1 padded
            weight_ptr=weight,  # [B, N+1] work dtype: read (univer: P~ of the node), written (children)
            stop_ptr=stop,  # [B, N+1] work dtype: h of the node (univer)
            q_bar_scale_ptr=q_bar_scale,  # [B, N+1] float64: 1 / q(off T), 0 without a sampled child
            stride_pb=p.stride(0),
            stride_pn=p.stride(1),
            stride_qb=q.stride(0),
            stride_qn=q.stride(1),
            stride_tb=tokens.stride(0),
            stride_cb=stride_cb,
            stride_cn=stride_cn,
            stride_wb=weight.stride(0),
            vocab=vocab,  # V
            num_slots=children.shape[-1],  # C: child slots per node
            RULE=RULES[rule],
            SLOTS=slots,  # num_slots rounded up to a power of 2
            BLOCK_V=block_v,
        )
        return
    parts = torch.empty(batch, num_nodes, splits, 3, dtype=torch.float64, device=p.device)
    _topk1_split_sums_kernel[(batch, num_nodes, splits)](
        p_ptr=p,  # [B, N+1, V] target rows p (any float dtype, V contiguous)
        q_ptr=q,  # [B, N+1, V] draft rows q: what each node's children were drawn from
        nodes_ptr=nodes,  # [n] int64: the level's node ids
        parts_ptr=parts,  # [B, n, S, 3] float64: per slice sum p, sum q (and F' for the min kernel)
        stride_pb=p.stride(0),
        stride_pn=p.stride(1),
        stride_qb=q.stride(0),
        stride_qn=q.stride(1),
        stride_xb=parts.stride(0),
        stride_xn=parts.stride(1),
        vocab=vocab,  # V
        chunk=chunk,  # vocabulary entries per slice
        RULE=RULES[rule],
        BLOCK_V=block_v,
    )
    if rule != "target_only":
        _topk1_split_min_kernel[(batch, num_nodes, splits)](
            p_ptr=p,  # [B, N+1, V] target rows p (any float dtype, V contiguous)
            q_ptr=q,  # [B, N+1, V] draft rows q: what each node's children were drawn from
            tokens_ptr=tokens,  # [B, N+1] int64 draft tokens (-1: the node does not exist)
            nodes_ptr=nodes,  # [n] int64: the level's node ids
            children_ptr=children,  # [N+1, C] int64: each node's children in slot order, -1 padded
            weight_ptr=weight,  # [B, N+1] work dtype: read (univer: P~ of the node), written (children)
            parts_ptr=parts,  # [B, n, S, 3] float64: per slice sum p, sum q, and F' for the finish kernel
            stride_pb=p.stride(0),
            stride_pn=p.stride(1),
            stride_qb=q.stride(0),
            stride_qn=q.stride(1),
            stride_tb=tokens.stride(0),
            stride_cb=stride_cb,
            stride_cn=stride_cn,
            stride_wb=weight.stride(0),
            stride_xb=parts.stride(0),
            stride_xn=parts.stride(1),
            vocab=vocab,  # V
            num_slots=children.shape[-1],  # C: child slots per node
            chunk=chunk,  # vocabulary entries per slice
            num_splits=splits,  # S: vocabulary slices per node
            RULE=RULES[rule],
            SLOTS=slots,
            SPLITS=triton.next_power_of_2(splits),  # num_splits rounded up to a power of 2
            BLOCK_V=block_v,
        )
    _topk1_split_finish_kernel[(batch, num_nodes)](
        p_ptr=p,  # [B, N+1, V] target rows p (any float dtype, V contiguous)
        q_ptr=q,  # [B, N+1, V] draft rows q: what each node's children were drawn from
        tokens_ptr=tokens,  # [B, N+1] int64 draft tokens (-1: the node does not exist)
        nodes_ptr=nodes,  # [n] int64: the level's node ids
        children_ptr=children,  # [N+1, C] int64: each node's children in slot order, -1 padded
        weight_ptr=weight,  # [B, N+1] work dtype: read (univer: P~ of the node), written (children)
        stop_ptr=stop,  # [B, N+1] work dtype, written: h of the node (univer)
        q_bar_scale_ptr=q_bar_scale,  # [B, N+1] float64: 1 / q(off T), 0 without a sampled child
        parts_ptr=parts,  # [B, n, S, 3] float64: per slice sum p, sum q, and F' for the finish kernel
        stride_pb=p.stride(0),
        stride_pn=p.stride(1),
        stride_qb=q.stride(0),
        stride_qn=q.stride(1),
        stride_tb=tokens.stride(0),
        stride_cb=stride_cb,
        stride_cn=stride_cn,
        stride_wb=weight.stride(0),
        stride_xb=parts.stride(0),
        stride_xn=parts.stride(1),
        num_slots=children.shape[-1],  # C: child slots per node
        num_splits=splits,  # S: vocabulary slices per node
        RULE=RULES[rule],
        SLOTS=slots,
        SPLITS=triton.next_power_of_2(splits),
    )
