"""Triton kernel: the node rules of the ``topk1`` verifiers (univer, greedy) and
of target_only, one launch per depth level (the CUDA path of ``verify``).

The PyTorch node rules (``verifiers/univer.py``, ``greedy.py``,
``target_only.py``) issue ~100 small ATen ops per level, each a kernel launch on
CUDA: a 2x5 tree took 5.4 ms per ``verify`` on an H200 whatever the batch.
Here one program per (request, node of the level) reads the node's p and q rows
and does the whole rule:

    pass 1   q(off T)                       (target_only: p off every child token)
    pass 2   rho = sum_{y not in T} [P~ p(y) - q(y) / q(off T)]+   (univer, greedy)
    then     the rule's O(C) arithmetic on the child slots, exactly as the
             PyTorch rule writes it (same formulas, float64 accumulation),

and writes each child's weight (P~ for univer, alpha for the DESCENT rules),
the node's stop probability h (univer) and the factor 1 / q(off T) that turns q
into q_bar (0 when the node has no sampled child) for the residual draw.

Where a level has too few nodes to fill the GPU (one request: a single program
streams the root's 152k-token rows twice), the vocabulary is split: a level
then takes three launches, each program on one slice of one node's rows:

    sums     partial masses off the set per slice
    excess   partial rho per slice (from the node's q(off T) and entry scale)
    finish   the slices' partials added in a fixed order, then the O(C) rule

with the same formulas (only the order of the float64 additions differs).
Every mass is a masked sum over the tokens off a set and every room a sum of what
is left, never a total minus a part (``ops.mass_off``): the rules stay exact when
the draft's top tokens hold all but 1e-30 of its mass.
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
def _masked_set(slot, tok, RULE: tl.constexpr):
    # The tokens a node's masses leave out [SLOTS] (-1: none): the top set T (slots 1..)
    # for univer / greedy, every child token for target_only.
    if RULE == TARGET_ONLY:
        return tok
    return tl.where(slot >= 1, tok, -1)


@triton.jit
def _off_set(idx, set_tok):
    # [BLOCK_V] bool: the ids ``idx`` that are not among ``set_tok`` [SLOTS] (-1 matches none).
    listed = tl.sum((idx[:, None] == set_tok[None, :]).to(tl.int32), axis=1)
    return listed == 0


@triton.jit
def _row_masses(p_row, q_row, lo, hi, set_tok, RULE: tl.constexpr, BLOCK_V: tl.constexpr):
    # (p off the set, q off the set) over the tokens [lo, hi): masked sums in float64
    # (target_only reads p only, the topk1 rules q only; the other is 0).
    offs = tl.arange(0, BLOCK_V)
    p_acc = tl.zeros([BLOCK_V], dtype=tl.float64)
    q_acc = tl.zeros([BLOCK_V], dtype=tl.float64)
    for start in range(lo, hi, BLOCK_V):
        keep = (start + offs < hi) & _off_set(start + offs, set_tok)
        if RULE == TARGET_ONLY:
            p_acc += tl.load(p_row + start + offs, mask=keep, other=0.0).to(tl.float64)
        else:
            q_acc += tl.load(q_row + start + offs, mask=keep, other=0.0).to(tl.float64)
    return tl.sum(p_acc, axis=0), tl.sum(q_acc, axis=0)


@triton.jit
def _excess_sum(p_row, q_row, scale, q_bar_scale, set_tok, lo, hi, BLOCK_V: tl.constexpr):
    # rho = sum_{y not in T} [scale p(y) - q_bar_scale q(y)]+ over the tokens [lo, hi) in float64.
    offs = tl.arange(0, BLOCK_V)
    acc = tl.zeros([BLOCK_V], dtype=tl.float64)
    for start in range(lo, hi, BLOCK_V):
        keep = (start + offs < hi) & _off_set(start + offs, set_tok)
        p_blk = tl.load(p_row + start + offs, mask=keep, other=0.0).to(tl.float64)
        q_blk = tl.load(q_row + start + offs, mask=keep, other=0.0).to(tl.float64)
        acc += tl.maximum(p_blk * scale - q_blk * q_bar_scale, 0.0)
    return tl.sum(acc, axis=0)


@triton.jit
def _suffix_sum(x, slot):
    # sum_{i >= j} x_i for every slot j [SLOTS]: what is left from slot j on, summed.
    return tl.sum(tl.where(slot[None, :] >= slot[:, None], x[None, :], 0.0), axis=1)


@triton.jit
def _node_scale(weight_ptr, b, stride_wb, node, RULE: tl.constexpr):
    # P~ on entry to the node for univer (written by the level above), 1 for greedy / target_only.
    return entry_scale(weight_ptr, b, stride_wb, node, RULE == UNIVER)


@triton.jit
def _q_bar_scale(q_off, slot, tok):
    """Topk1Node.read: slot 0 the sampled child r ~ q_bar = q / q(off T) off the top set
    T (slots 1..) -> 1 / q(off T), 0 without a sampled child (slot 0 missing or an
    empty residual)."""
    r_tok = tl.sum(tl.where(slot == 0, tok, 0), axis=0)
    has_sampled = (r_tok >= 0) & (q_off > 0)
    return tl.where(has_sampled, 1.0 / tl.where(has_sampled, q_off, 1.0), 0.0)


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
    p_off,
    q_off,
    rho,
    RULE: tl.constexpr,
):
    """The rule's O(C) arithmetic on the node's child slots, from its entry scale
    ``scale`` (``_node_scale``), its masses off the set (``_row_masses``: p off every
    child for target_only, q(off T) for the topk1 rules) and
    ``rho`` = sum_{y not in T} [P~ p(y) - q_bar(y)]+ (unused by target_only), exactly
    as the PyTorch rule writes it: writes the children's weights, h (univer) and
    1 / q(off T) (0 without a sampled child)."""
    has_tok = tok >= 0
    p_tok = tl.load(p_row + tl.maximum(tok, 0), mask=has_tok, other=0.0).to(tl.float64)
    if RULE == TARGET_ONLY:
        # alpha_j = p(x_j) / (p off every child + p of the distinct later children); a repeat gets 0.
        earlier = (tok[:, None] == tok[None, :]) & (slot[None, :] < slot[:, None])
        first = has_tok & (tl.max(earlier.to(tl.int32), axis=1) == 0)
        mass = tl.where(first, p_tok, 0.0)
        child = clipped_ratio(mass, p_off + _suffix_sum(mass, slot))
    else:
        q_tok = tl.load(q_row + tl.maximum(tok, 0), mask=has_tok, other=0.0).to(tl.float64)
        q_bar_scale = _q_bar_scale(q_off, slot, tok)
        p_r = tl.sum(tl.where(slot == 0, p_tok, 0.0), axis=0)
        q_bar_r = tl.sum(tl.where(slot == 0, q_tok, 0.0), axis=0) * q_bar_scale
        p_top = tl.where(has_tok & (slot >= 1), p_tok, 0.0)
        if RULE == UNIVER:
            top_mass = scale * p_top
            stop = stop_prob(rho, scale)
            tl.store(stop_ptr + b * stride_wb + node, stop.to(stop_ptr.dtype.element_ty))
            # 1 - F - sum_{i<j} P~ p(u_i), summed from what is left (univer.py).
            room = (1.0 - scale) + rho + _suffix_sum(top_mass, slot)
            child = tl.where(slot == 0, clipped_ratio(scale * p_r, q_bar_r), clipped_ratio(top_mass, room))
        else:  # GREEDY
            room = rho + _suffix_sum(p_top, slot)
            child = tl.where(slot == 0, clipped_ratio(p_r, q_bar_r), clipped_ratio(p_top, room))
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
    set_tok = _masked_set(slot, tok, RULE)
    p_off, q_off = _row_masses(p_row, q_row, 0, vocab, set_tok, RULE, BLOCK_V)
    scale = _node_scale(weight_ptr, b, stride_wb, node, RULE)
    rho = tl.zeros((), dtype=tl.float64)
    if RULE != TARGET_ONLY:
        rho = _excess_sum(p_row, q_row, scale, _q_bar_scale(q_off, slot, tok), set_tok, 0, vocab, BLOCK_V)
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
        p_off,
        q_off,
        rho,
        RULE,
    )


@triton.jit
def _topk1_split_sums_kernel(
    p_ptr,  # [B, N+1, V] target rows p (any float dtype, V contiguous)
    q_ptr,  # [B, N+1, V] draft rows q: what each node's children were drawn from
    tokens_ptr,  # [B, N+1] int64 draft tokens (-1: the node does not exist)
    nodes_ptr,  # [n] int64: the level's node ids
    children_ptr,  # [N+1, C] int64: each node's children in slot order, -1 padded
    parts_ptr,  # [B, n, S, 3] float64: per slice p and q off the set (and rho for the excess kernel)
    stride_pb,
    stride_pn,
    stride_qb,
    stride_qn,
    stride_tb,
    stride_cb,  # 0: one tree for the batch; else each request's own children
    stride_cn,
    stride_xb,
    stride_xn,
    vocab,  # V
    num_slots,  # C: child slots per node
    chunk,  # vocabulary entries per slice
    RULE: tl.constexpr,
    SLOTS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # One program per (request, node of the level, vocabulary slice).
    b, i, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    node = tl.load(nodes_ptr + i)
    lo = s * chunk
    hi = tl.minimum(lo + chunk, vocab)
    p_row, q_row = node_rows(p_ptr, q_ptr, b, node, stride_pb, stride_pn, stride_qb, stride_qn)
    slot, _, tok = child_slots(
        children_ptr + b * stride_cb, tokens_ptr, b, node, stride_tb, stride_cn, num_slots, SLOTS
    )
    p_off, q_off = _row_masses(p_row, q_row, lo, hi, _masked_set(slot, tok, RULE), RULE, BLOCK_V)
    part = parts_ptr + b * stride_xb + i * stride_xn + s * 3
    tl.store(part, p_off)
    tl.store(part + 1, q_off)


@triton.jit
def _split_total(parts_ptr, b, i, column, stride_xb, stride_xn, num_splits, SPLITS: tl.constexpr):
    # One column of a node's slice partials (0: p off the set, 1: q off the set, 2: rho) added in a fixed order.
    s = tl.arange(0, SPLITS)
    part = parts_ptr + b * stride_xb + i * stride_xn + s * 3 + column
    return tl.sum(tl.load(part, mask=s < num_splits, other=0.0), axis=0)


@triton.jit
def _topk1_split_excess_kernel(
    p_ptr,  # [B, N+1, V] target rows p (any float dtype, V contiguous)
    q_ptr,  # [B, N+1, V] draft rows q: what each node's children were drawn from
    tokens_ptr,  # [B, N+1] int64 draft tokens (-1: the node does not exist)
    nodes_ptr,  # [n] int64: the level's node ids
    children_ptr,  # [N+1, C] int64: each node's children in slot order, -1 padded
    weight_ptr,  # [B, N+1] work dtype: read (univer: P~ of the node), written (children)
    parts_ptr,  # [B, n, S, 3] float64: per slice p and q off the set, and rho for the finish kernel
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
    # One program per (request, node of the level, vocabulary slice): the slice's rho.
    b, i, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    node = tl.load(nodes_ptr + i)
    p_row, q_row = node_rows(p_ptr, q_ptr, b, node, stride_pb, stride_pn, stride_qb, stride_qn)
    slot, _, tok = child_slots(
        children_ptr + b * stride_cb, tokens_ptr, b, node, stride_tb, stride_cn, num_slots, SLOTS
    )
    # rho is not written yet: only q(off T) is read.
    q_off = _split_total(parts_ptr, b, i, 1, stride_xb, stride_xn, num_splits, SPLITS)
    scale = _node_scale(weight_ptr, b, stride_wb, node, RULE)
    set_tok = _masked_set(slot, tok, RULE)
    lo = s * chunk
    rho = _excess_sum(
        p_row, q_row, scale, _q_bar_scale(q_off, slot, tok), set_tok, lo, tl.minimum(lo + chunk, vocab), BLOCK_V
    )
    tl.store(parts_ptr + b * stride_xb + i * stride_xn + s * 3 + 2, rho)


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
    parts_ptr,  # [B, n, S, 3] float64: per slice p and q off the set, and rho for the finish kernel
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
    p_off = _split_total(parts_ptr, b, i, 0, stride_xb, stride_xn, num_splits, SPLITS)
    q_off = _split_total(parts_ptr, b, i, 1, stride_xb, stride_xn, num_splits, SPLITS)
    rho = tl.zeros((), dtype=tl.float64)
    if RULE != TARGET_ONLY:
        rho = _split_total(parts_ptr, b, i, 2, stride_xb, stride_xn, num_splits, SPLITS)
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
        p_off,
        q_off,
        rho,
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
        tokens_ptr=tokens,  # [B, N+1] int64 draft tokens (-1: the node does not exist)
        nodes_ptr=nodes,  # [n] int64: the level's node ids
        children_ptr=children,  # [N+1, C] int64: each node's children in slot order, -1 padded
        parts_ptr=parts,  # [B, n, S, 3] float64: per slice p and q off the set (and rho for the excess kernel)
        stride_pb=p.stride(0),
        stride_pn=p.stride(1),
        stride_qb=q.stride(0),
        stride_qn=q.stride(1),
        stride_tb=tokens.stride(0),
        stride_cb=stride_cb,
        stride_cn=stride_cn,
        stride_xb=parts.stride(0),
        stride_xn=parts.stride(1),
        vocab=vocab,  # V
        num_slots=children.shape[-1],  # C: child slots per node
        chunk=chunk,  # vocabulary entries per slice
        RULE=RULES[rule],
        SLOTS=slots,
        BLOCK_V=block_v,
    )
    if rule != "target_only":
        _topk1_split_excess_kernel[(batch, num_nodes, splits)](
            p_ptr=p,  # [B, N+1, V] target rows p (any float dtype, V contiguous)
            q_ptr=q,  # [B, N+1, V] draft rows q: what each node's children were drawn from
            tokens_ptr=tokens,  # [B, N+1] int64 draft tokens (-1: the node does not exist)
            nodes_ptr=nodes,  # [n] int64: the level's node ids
            children_ptr=children,  # [N+1, C] int64: each node's children in slot order, -1 padded
            weight_ptr=weight,  # [B, N+1] work dtype: read (univer: P~ of the node), written (children)
            parts_ptr=parts,  # [B, n, S, 3] float64: per slice p and q off the set, and rho for the finish kernel
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
        parts_ptr=parts,  # [B, n, S, 3] float64: per slice p and q off the set, and rho for the finish kernel
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
