"""Triton helpers shared by the fused verify kernels: the clipped ratio of the
PyTorch rules, the rejection replay of rrs / rrsw / traversal, and the draw of
the next token from one node's residual row.

A residual row is, per token y of the vocabulary, by ``kind``:

    RESIDUAL_CLIPPED  r(y) = max(scale p(y) - q_scale q(y), 0), 0 at the removed tokens
                      (univer and block: scale = P~, q_scale = 1 / q(off T) or 1 at a
                      node with a child, 0 at a leaf; token: scale 1)
    RESIDUAL_P        r(y) = p(y), 0 at the removed tokens (target_only)
    RESIDUAL_REPLAY   r(y) = R_k(y) of ``replay_row``: the node's k rejections
                      replayed from p and q (rrs, rrsw, traversal)

It is drawn by a float64 inverse CDF in two passes over the vocabulary, never
writing a [V] row.

Where a verify level has too few (request, node) programs to fill the GPU, the
kernels split each node's vocabulary into slices (``vocab_slices``).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@triton.jit
def child_slots(children_ptr, tokens_ptr, b, node, stride_tb, stride_cn, num_slots, SLOTS: tl.constexpr):
    # The node's child slots [SLOTS], their node ids (-1: none) and tokens (-1: missing).
    slot = tl.arange(0, SLOTS)
    kid = tl.load(children_ptr + node * stride_cn + slot, mask=slot < num_slots, other=-1)
    tok = tl.load(tokens_ptr + b * stride_tb + tl.maximum(kid, 0), mask=kid >= 0, other=-1)
    return slot, kid, tok


@triton.jit
def node_rows(p_ptr, q_ptr, b, node, stride_pb, stride_pn, stride_qb, stride_qn):
    # Request b's p and q rows at ``node`` (pointers to their first token).
    return p_ptr + b * stride_pb + node * stride_pn, q_ptr + b * stride_qb + node * stride_qn


@triton.jit
def entry_scale(weight_ptr, b, stride_wb, node, SCALED: tl.constexpr):
    # The node's prefix scale P~ where the rule carries one (univer, traversal: the entry
    # weight written by the level above), else 1 (the DESCENT rules).
    if SCALED:
        return tl.load(weight_ptr + b * stride_wb + node).to(tl.float64)
    return tl.full((), 1.0, tl.float64)


@triton.jit
def clipped_ratio(num, den):
    # min(1, num / den) for num, den >= 0, with x/0 = 1 for x > 0 and 0/0 = 0 (ops.clipped_ratio).
    safe = tl.where(den > 0, den, 1.0)
    ratio = tl.where(den > 0, num / safe, tl.where(num > 0, 1.0, 0.0))
    return tl.minimum(ratio, 1.0)


@triton.jit
def stop_prob(mass, scale):
    # h = mass / (mass + 1 - scale), 1 where the denominator is 0 (ops.stop_prob).
    den = mass + (1.0 - scale)
    stop = tl.where(den > 0, mass / tl.where(den > 0, den, 1.0), 1.0)
    return tl.minimum(tl.maximum(stop, 0.0), 1.0)


# Kernel-visible constants must be tl.constexpr (compiled Triton rejects plain globals; the
# interpreter does not); host code passes their ``.value``.
RESIDUAL_CLIPPED, RESIDUAL_P, RESIDUAL_REPLAY = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)

# safe_ratio's clamp: a coefficient that may multiply zeros is never inf.
FLOAT64_MAX = tl.constexpr(1.7976931348623157e308)


@triton.jit
def safe_ratio(num, den):
    # num / den where den > 0, else 0, at most the largest float64 (ops.safe_ratio).
    ratio = tl.where(den > 0, num / tl.where(den > 0, den, 1.0), 0.0)
    return tl.minimum(ratio, FLOAT64_MAX)


@triton.jit
def replay_row(p_vals, q_vals, idx, tokens, slot, a_vec, c_vec, steps, REMOVES: tl.constexpr):
    """(R_k, Q_k) at the tokens ``idx`` (a vocabulary block, or a node's child
    tokens; -1 matches none) from p_vals, q_vals there (float64), after the
    first k = ``steps`` rejections of ``rejection_replay.RejectionReplay``:

        R_{i+1} = [a_i R_i - c_i Q_i]+,  Q_{i+1} = Q_i with Q(x_i) = 0 (REMOVES) or Q_i,

    where Q_i(x) = 0 makes the step R_{i+1}(x) = a_i R_i(x). Step i's a_i, c_i and
    x_i are the entries of a_vec, c_vec, tokens [SLOTS] at ``slot`` == i (a = 1,
    c = 0 leave a row as it is)."""
    rows = p_vals
    gone = idx < -1  # all False: no token removed yet
    for i in range(0, steps):
        at_step = slot == i
        a = tl.sum(tl.where(at_step, a_vec, 0.0), axis=0)
        c = tl.sum(tl.where(at_step, c_vec, 0.0), axis=0)
        rows = tl.where(gone, rows * a, tl.maximum(rows * a - c * q_vals, 0.0))
        if REMOVES:
            x = tl.sum(tl.where(at_step, tokens, 0), axis=0)
            gone = gone | ((idx == x) & (x >= 0))
    return rows, tl.where(gone, 0.0, q_vals)


@triton.jit
def _residual_block(
    p_row, q_row, idx, vocab, tokens, slot, scale, q_scale, a_vec, c_vec, KIND: tl.constexpr, REMOVES: tl.constexpr
):
    # (r, p) on the vocabulary block ``idx`` (float64; 0 past the end).
    inside = idx < vocab
    p_blk = tl.load(p_row + idx, mask=inside, other=0.0).to(tl.float64)
    q_blk = tl.load(q_row + idx, mask=inside, other=0.0).to(tl.float64)
    if KIND == RESIDUAL_REPLAY:
        res, _ = replay_row(p_blk, q_blk, idx, tokens, slot, a_vec, c_vec, tokens.shape[0], REMOVES)
    else:
        if KIND == RESIDUAL_P:
            res = p_blk
        else:
            res = tl.maximum(scale * p_blk - q_blk * q_scale, 0.0)
        in_set = tl.max((idx[:, None] == tokens[None, :]).to(tl.int32), axis=1) > 0
        res = tl.where(in_set, 0.0, res)
    return res, p_blk


@triton.jit
def draw_excluding(row, excluded, slot, uniform, vocab, BLOCK_V: tl.constexpr):
    """The token at ``uniform`` (float64 in [0, 1)) of the inverse CDF of ``row``
    (a draft row q >= 0) with the tokens ``excluded`` [SLOTS] (-1: none) at 0;
    -1 where nothing is left (the draft schemes' missing child)."""
    one = tl.full((), 1.0, tl.float64)
    choice, total = draw_residual(
        row, row, excluded, slot, one, one, one, one, uniform, vocab, RESIDUAL_P, False, False, BLOCK_V
    )
    return tl.where(total > 0, choice, -1)


@triton.jit
def draw_residual(
    p_row,
    q_row,
    tokens,
    slot,
    scale,
    q_scale,
    a_vec,
    c_vec,
    uniform,
    vocab,
    KIND: tl.constexpr,
    REMOVES: tl.constexpr,
    FALLBACK_P: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """(the token at ``uniform`` (float64 in [0, 1)) of the residual row's inverse
    CDF, the row's mass): module docstring; ``tokens`` [SLOTS] the removed tokens,
    or the replay's x_i, -1: none; ``slot`` = arange(SLOTS); scale, q_scale read
    by RESIDUAL_CLIPPED, a_vec, c_vec [SLOTS] by RESIDUAL_REPLAY. An empty
    residual (probability 0 in exact arithmetic) draws from p with FALLBACK_P, as
    ``verify`` does; without it the token is then meaningless."""
    offs = tl.arange(0, BLOCK_V)
    res_acc = tl.zeros([BLOCK_V], dtype=tl.float64)
    p_acc = tl.zeros([BLOCK_V], dtype=tl.float64)
    for start in range(0, vocab, BLOCK_V):
        res, p_blk = _residual_block(
            p_row, q_row, start + offs, vocab, tokens, slot, scale, q_scale, a_vec, c_vec, KIND, REMOVES
        )
        res_acc += res
        p_acc += p_blk
    res_total = tl.sum(res_acc, axis=0)
    use_p = (res_total <= 0) & FALLBACK_P
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
        res, p_blk = _residual_block(
            p_row, q_row, idx, vocab, tokens, slot, scale, q_scale, a_vec, c_vec, KIND, REMOVES
        )
        w = tl.where(use_p, p_blk, res)
        running, found, choice, last_positive = inverse_cdf_step(
            w, idx, vocab, target, running, found, choice, last_positive
        )
    return tl.where(found == 1, choice, last_positive), res_total


@triton.jit
def inverse_cdf_step(w, idx, vocab, target, running, found, choice, last_positive):
    """One block of an inverse CDF's second pass over weights ``w`` (float64) at the tokens
    ``idx``: the first token whose running mass exceeds ``target`` (the block's last
    positive token if rounding inside it says otherwise) -> the updated running mass,
    found (int32), choice and last positive token (int64)."""
    block_total = tl.sum(w, axis=0)
    crosses = (running + tl.cumsum(w, axis=0) > target) & (w > 0)
    first = tl.min(tl.where(crosses, idx, vocab), axis=0)
    positive_here = tl.max(tl.where(w > 0, idx, -1), axis=0)
    last_positive = tl.where(positive_here >= 0, positive_here.to(tl.int64), last_positive)
    block_holds = (found == 0) & (running + block_total > target)
    choice = tl.where(block_holds, tl.where(first < vocab, first.to(tl.int64), last_positive), choice)
    found = tl.where(block_holds, 1, found)
    return running + block_total, found, choice, last_positive


@triton.jit
def first_argmax(p_row, vocab, BLOCK_V: tl.constexpr):
    # argmax of one row, the first index on ties (torch.argmax's).
    return top_token(p_row, tl.full([2], -1, tl.int64), vocab, BLOCK_V)


@triton.jit
def top_token(row, excluded, vocab, BLOCK_V: tl.constexpr):
    """The largest entry of ``row`` (probabilities or logits, -inf allowed) off
    the tokens ``excluded`` [SLOTS] (-1: none), the first index on ties: called
    k times with the earlier winners excluded, ``drafting.top_tokens``'s order."""
    offs = tl.arange(0, BLOCK_V)
    best = tl.full((), float("-inf"), tl.float64)
    best_index = tl.full((), -1, tl.int64)
    for start in range(0, vocab, BLOCK_V):
        idx = start + offs
        allowed = (idx < vocab) & (tl.max((idx[:, None] == excluded[None, :]).to(tl.int32), axis=1) == 0)
        vals = tl.load(row + idx, mask=idx < vocab, other=0.0).to(tl.float64)
        vals = tl.where(allowed, vals, float("-inf"))
        top = tl.max(vals, axis=0)
        first = tl.min(tl.where(allowed & (vals == top), idx, vocab), axis=0).to(tl.int64)
        better = (first < vocab) & ((top > best) | (best_index < 0))
        best_index = tl.where(better, first, best_index)
        best = tl.where(better, top, best)
    return best_index


# The largest vocabulary block of the verify and drafting kernels. Their passes keep
# a few [BLOCK_V] float64 arrays live per program; which block runs fastest is a
# GPU measurement (``benchmarks/gpu_check.py`` sweeps this value).
MAX_BLOCK_V = 4096


def block_size(vocab: int) -> int:
    """Vocabulary block of one program's passes."""
    return min(MAX_BLOCK_V, triton.next_power_of_2(vocab))


def slot_block(num_slots: int) -> int:
    """Child slots held in one program's registers: a power of two (Triton's
    ``tl.arange``), at least 2 (a one-child node still reads a [2] block)."""
    return triton.next_power_of_2(max(num_slots, 2))


SPLITS_ENV = "VLLM_UNIVER_VERIFY_SPLITS"
# A slice holds at least this many tokens (one full block); at most this many slices.
MIN_SPLIT_V = 4096
MAX_VOCAB_SPLITS = 64


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def split_count(programs: int, vocab: int, multiprocessors: int) -> int:
    """Vocabulary slices per node so that a level of ``programs`` (request, node) pairs
    fills the GPU: about two programs per multiprocessor, each slice at least
    ``MIN_SPLIT_V`` tokens, at most ``MAX_VOCAB_SPLITS``; 1 where the level fills it."""
    if programs >= multiprocessors:
        return 1
    wanted = triton.cdiv(2 * multiprocessors, max(programs, 1))
    return int(max(1, min(MAX_VOCAB_SPLITS, wanted, vocab // MIN_SPLIT_V)))


def vocab_splits(device: torch.device, programs: int, vocab: int) -> int:
    """Slices per node for a level of ``programs`` (request, node) pairs on ``device``
    (``split_count``; 1 off CUDA). ``VLLM_UNIVER_VERIFY_SPLITS`` forces the count."""
    forced = os.environ.get(SPLITS_ENV)
    if forced:
        return max(1, min(int(forced), vocab))
    if device.type != "cuda":
        return 1
    return split_count(programs, vocab, _multiprocessors(device.index if device.index is not None else 0))


def vocab_slices(device: torch.device, programs: int, vocab: int) -> tuple[int, int, int]:
    """How a verify level of ``programs`` (request, node) pairs reads each node's rows:
    (slices, tokens per slice, vocabulary block). One slice of ``vocab`` tokens where
    ``vocab_splits`` says 1; otherwise equal slices, none of them empty, and a block
    no wider than a slice."""
    splits = vocab_splits(device, programs, vocab)
    if splits == 1:
        return 1, vocab, block_size(vocab)
    chunk = triton.cdiv(vocab, splits)
    return triton.cdiv(vocab, chunk), chunk, min(block_size(vocab), triton.next_power_of_2(chunk))
