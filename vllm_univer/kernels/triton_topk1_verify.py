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

The rest of the step is ``triton_finish_step``.

Tensors: p, q [B, N+1, V] (last dim contiguous; float32, bfloat16 or float64);
tokens [B, N+1] int64 (-1: missing); children [N+1, C] int64 (-1 padded).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_rows import block_size, child_slots, clipped_ratio, continue_prob, slot_block

# Kernel-visible constants must be tl.constexpr (compiled Triton rejects plain globals; the
# interpreter does not); host code passes their ``.value``.
UNIVER, GREEDY, TARGET_ONLY = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
RULES = {"univer": UNIVER.value, "greedy": GREEDY.value, "target_only": TARGET_ONLY.value}


@triton.jit
def _entry_scale(weight_ptr, b, stride_wb, node, RULE: tl.constexpr):
    # The node's prefix scale P~ (univer); 1 for the DESCENT rules.
    if RULE == UNIVER:
        return tl.load(weight_ptr + b * stride_wb + node).to(tl.float64)
    return tl.full((), 1.0, tl.float64)


@triton.jit
def _topk1_level_kernel(
    p_ptr,
    q_ptr,
    tokens_ptr,
    nodes_ptr,
    children_ptr,
    weight_ptr,  # [B, N+1] work dtype: read (univer: P~ of the node), written (children)
    stop_ptr,  # [B, N+1] work dtype: h of the node (univer)
    q_bar_scale_ptr,  # [B, N+1] float64: 1 / q(off T), 0 without a sampled child
    stride_pb,
    stride_pn,
    stride_qb,
    stride_qn,
    stride_tb,
    stride_cn,
    stride_wb,
    vocab,
    num_slots,
    RULE: tl.constexpr,
    SLOTS: tl.constexpr,  # num_slots rounded up to a power of 2
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0)
    node = tl.load(nodes_ptr + tl.program_id(1))
    p_row = p_ptr + b * stride_pb + node * stride_pn
    q_row = q_ptr + b * stride_qb + node * stride_qn

    slot, kid, tok = child_slots(children_ptr, tokens_ptr, b, node, stride_tb, stride_cn, num_slots, SLOTS)
    has_tok = tok >= 0
    p_tok = tl.load(p_row + tl.maximum(tok, 0), mask=has_tok, other=0.0).to(tl.float64)

    offs = tl.arange(0, BLOCK_V)
    p_acc = tl.zeros([BLOCK_V], dtype=tl.float64)
    q_acc = tl.zeros([BLOCK_V], dtype=tl.float64)
    for start in range(0, vocab, BLOCK_V):
        inside = start + offs < vocab
        p_acc += tl.load(p_row + start + offs, mask=inside, other=0.0).to(tl.float64)
        if RULE != TARGET_ONLY:
            q_acc += tl.load(q_row + start + offs, mask=inside, other=0.0).to(tl.float64)
    p_sum = tl.sum(p_acc, axis=0)

    if RULE == TARGET_ONLY:
        # alpha_j = p(x_j) / (sum p - p of the distinct earlier tokens); a repeat gets 0.
        earlier = (tok[:, None] == tok[None, :]) & (slot[None, :] < slot[:, None])
        first = has_tok & (tl.max(earlier.to(tl.int32), axis=1) == 0)
        mass = tl.where(first, p_tok, 0.0)
        child = clipped_ratio(mass, tl.maximum(p_sum - (tl.cumsum(mass, axis=0) - mass), 0.0))
    else:
        # Topk1Node.read: slot 0 the sampled child r ~ q_bar, slots 1.. the top set T.
        q_tok = tl.load(q_row + tl.maximum(tok, 0), mask=has_tok, other=0.0).to(tl.float64)
        on_top = has_tok & (slot >= 1)
        q_off = tl.sum(q_acc, axis=0) - tl.sum(tl.where(on_top, q_tok, 0.0), axis=0)
        r_tok = tl.sum(tl.where(slot == 0, tok, 0), axis=0)
        p_r = tl.sum(tl.where(slot == 0, p_tok, 0.0), axis=0)
        q_r = tl.sum(tl.where(slot == 0, q_tok, 0.0), axis=0)
        has_sampled = (r_tok >= 0) & (q_off > 0)
        q_off = tl.where(has_sampled, q_off, 1.0)
        scale = _entry_scale(weight_ptr, b, stride_wb, node, RULE)
        # F = sum_{y not in T} min(q_bar(y), scale p(y)) = (sum_y min(q, scale q_off p) - on T) / q_off
        factor = scale * q_off
        full = tl.zeros([BLOCK_V], dtype=tl.float64)
        for start in range(0, vocab, BLOCK_V):
            inside = start + offs < vocab
            p_blk = tl.load(p_row + start + offs, mask=inside, other=0.0).to(tl.float64)
            q_blk = tl.load(q_row + start + offs, mask=inside, other=0.0).to(tl.float64)
            full += tl.minimum(q_blk, p_blk * factor)
        top_min = tl.sum(tl.where(on_top, tl.minimum(q_tok, p_tok * factor), 0.0), axis=0)
        carried = tl.maximum((tl.sum(full, axis=0) - top_min) / q_off, 0.0)
        carried = tl.where(has_sampled, carried, 0.0)
        q_bar_r = tl.where(has_sampled, q_r / q_off, 0.0)
        p_top = tl.where(on_top, p_tok, 0.0)
        if RULE == UNIVER:
            top_mass = scale * p_top
            rho = tl.maximum(scale * (p_sum - tl.sum(p_top, axis=0)) - carried, 0.0)
            stop = continue_prob(rho, scale)
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


def _launch_shape(num_slots: int, vocab: int) -> tuple[int, int]:
    return slot_block(num_slots), block_size(vocab)


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
    1 / q(off T) into ``q_bar_scale`` [B, N+1] float64."""
    batch, _, vocab = p.shape
    slots, block_v = _launch_shape(children.shape[1], vocab)
    _topk1_level_kernel[(batch, nodes.numel())](
        p, q, tokens, nodes, children, weight, stop, q_bar_scale,
        p.stride(0), p.stride(1), q.stride(0), q.stride(1), tokens.stride(0), children.stride(0), weight.stride(0),
        vocab, children.shape[1],
        RULE=RULES[rule], SLOTS=slots, BLOCK_V=block_v,
    )  # fmt: skip
