"""Triton helpers shared by the fused verify kernels: the clipped ratio of the
PyTorch rules and the draw of the next token from one node's residual row.

A residual row is, per token y of the vocabulary,

    r(y) = 0                                  y in the removed set (child tokens)
    r(y) = p(y)                               P_ONLY (target_only)
    r(y) = max(scale p(y) - q_scale q(y), 0)  otherwise

(univer and block: scale = P~, q_scale = 1 / q(off T) or 1 at a node with a
child, 0 at a leaf; token: scale 1). It is drawn by a float64 inverse CDF in
two passes over the vocabulary, never writing a [V] row.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def clipped_ratio(num, den):
    # min(1, num / den) for num, den >= 0, with x/0 = 1 for x > 0 and 0/0 = 0 (ops.clipped_ratio).
    safe = tl.where(den > 0, den, 1.0)
    ratio = tl.where(den > 0, num / safe, tl.where(num > 0, 1.0, 0.0))
    return tl.minimum(ratio, 1.0)


@triton.jit
def continue_prob(mass, scale):
    # h = mass / (mass + 1 - scale), 1 where the denominator is 0 (ops.continue_prob).
    den = mass + (1.0 - scale)
    stop = tl.where(den > 0, mass / tl.where(den > 0, den, 1.0), 1.0)
    return tl.minimum(tl.maximum(stop, 0.0), 1.0)


@triton.jit
def residual_weight(p_blk, q_blk, in_set, scale, q_scale, P_ONLY: tl.constexpr):
    # r(y) on one block of the vocabulary (see the module docstring).
    if P_ONLY:
        res = p_blk
    else:
        res = tl.maximum(scale * p_blk - q_blk * q_scale, 0.0)
    return tl.where(in_set, 0.0, res)


@triton.jit
def _residual_block(p_row, q_row, idx, vocab, removed, scale, q_scale, P_ONLY: tl.constexpr):
    # (r, p) on the vocabulary block ``idx`` (float64; 0 past the end).
    inside = idx < vocab
    p_blk = tl.load(p_row + idx, mask=inside, other=0.0).to(tl.float64)
    q_blk = tl.load(q_row + idx, mask=inside, other=0.0).to(tl.float64)
    in_set = tl.max((idx[:, None] == removed[None, :]).to(tl.int32), axis=1) > 0
    return residual_weight(p_blk, q_blk, in_set, scale, q_scale, P_ONLY), p_blk


@triton.jit
def draw_residual(p_row, q_row, removed, scale, q_scale, uniform, vocab, P_ONLY: tl.constexpr, BLOCK_V: tl.constexpr):
    """The token at ``uniform`` (float64 in [0, 1)) of the residual row's inverse
    CDF; ``removed`` [SLOTS] the tokens off the row (-1: none). An empty residual
    (probability 0 in exact arithmetic) draws from p, as ``verify`` does."""
    offs = tl.arange(0, BLOCK_V)
    res_acc = tl.zeros([BLOCK_V], dtype=tl.float64)
    p_acc = tl.zeros([BLOCK_V], dtype=tl.float64)
    for start in range(0, vocab, BLOCK_V):
        res, p_blk = _residual_block(p_row, q_row, start + offs, vocab, removed, scale, q_scale, P_ONLY)
        res_acc += res
        p_acc += p_blk
    res_total = tl.sum(res_acc, axis=0)
    use_p = res_total <= 0
    total = tl.where(use_p, tl.sum(p_acc, axis=0), res_total)
    target = uniform * total

    # The first token whose running mass exceeds the target; the block totals are
    # summed in the same order as above, so the last block always holds it (its
    # last positive token if rounding inside a block says otherwise).
    running = tl.zeros((), dtype=tl.float64)
    found = tl.zeros((), dtype=tl.int32)
    choice = tl.zeros((), dtype=tl.int64)
    last_positive = tl.zeros((), dtype=tl.int64)
    for start in range(0, vocab, BLOCK_V):
        idx = start + offs
        res, p_blk = _residual_block(p_row, q_row, idx, vocab, removed, scale, q_scale, P_ONLY)
        w = tl.where(use_p, p_blk, res)
        block_total = tl.sum(w, axis=0)
        crosses = (running + tl.cumsum(w, axis=0) > target) & (w > 0)
        first = tl.min(tl.where(crosses, idx, vocab), axis=0)
        positive_here = tl.max(tl.where(w > 0, idx, -1), axis=0)
        last_positive = tl.where(positive_here >= 0, positive_here.to(tl.int64), last_positive)
        block_holds = (found == 0) & (running + block_total > target)
        pick = tl.where(first < vocab, first.to(tl.int64), last_positive)
        choice = tl.where(block_holds, pick, choice)
        found = tl.where(block_holds, 1, found)
        running += block_total
    return tl.where(found == 1, choice, last_positive)


@triton.jit
def first_argmax(p_row, vocab, BLOCK_V: tl.constexpr):
    # argmax of one row, the first index on ties (torch.argmax's).
    offs = tl.arange(0, BLOCK_V)
    best = tl.full((), -1.0, tl.float64)
    best_index = tl.zeros((), dtype=tl.int64)
    for start in range(0, vocab, BLOCK_V):
        idx = start + offs
        p_blk = tl.load(p_row + idx, mask=idx < vocab, other=-1.0).to(tl.float64)
        top = tl.max(p_blk, axis=0)
        first = tl.min(tl.where(p_blk == top, idx, vocab), axis=0).to(tl.int64)
        better = top > best
        best_index = tl.where(better, first, best_index)
        best = tl.where(better, top, best)
    return best_index


def block_size(vocab: int) -> int:
    """Vocabulary block of one program's passes."""
    return min(4096, triton.next_power_of_2(vocab))
