"""Triton kernel: ``univer_wor``'s node rule for trees of at most two children per
node (2xD trees, binary irregular trees), one launch per depth level, and the
draw of the next token at the end node in one more launch (the CUDA path of
``verify``).

The PyTorch rule (``verifiers/univer_wor.py``) issues ~300 ATen ops per level,
each a kernel launch on CUDA (~1 550 per ``verify`` on a 2x5 tree). Here one
program per (request, node) does one node's pair stage:

    pass 1   sigma, sum q', sum [D - q']+, sum [q' - D]+ / (1 - q'); q' and
             u = q' / (1 - q') added per ratio class into the program's tables
    tables   Q_sel's partner sums per class (prefix sums + the tie share)
    pass 2   s = min(1, D / Q_sel), (1 - s) q' and (1 - s) u per class; the
             slot order's leftover
    tables   E2's partner sums per class
    pass 3   the selection's leftover and what it passes to slot a

then the choice between selection by ratio and slot order, the acceptances of
the two drawn children, and h. The formulas, the log-scale ratio classes (with
the uneven pairs' floor and tie rule) and their order are the PyTorch rule's;
every value is computed in float64. The draw recomputes the end node's stage
with the same code (so its residual R is that of the weights written) and then
takes R's inverse CDF at the step's uniform in two more passes.

Vocabularies up to ``EXACT_RANK_VOCAB`` (where the PyTorch rule compares exact
ratio ranks) and trees with three or more children at a node stay on the
PyTorch rule (``fused_tree_pass.fused_available``).

Per program the class tables take 4 x 2050 floats of scratch (global memory,
zeroed by the program); the histogram is built with atomic adds into them.
Tensors: p, q [B, N+1, V] (last dim contiguous; float32, bfloat16 or float64);
tokens [B, N+1] int64 (-1: missing); children, kid_sizes [N+1, C] int64, C <= 2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..verifiers.univer_wor import _CLASSES_PER_OCTAVE, _LOG_CLASSES, _OCTAVES
from .triton_rows import block_size, child_slots, clipped_ratio, continue_prob

NUM_CLASSES = tl.constexpr(_LOG_CLASSES)
CLASSES_PER_OCTAVE = tl.constexpr(float(_CLASSES_PER_OCTAVE))
HALF_OCTAVES = tl.constexpr(float(_OCTAVES // 2))
CLASS_BLOCK = tl.constexpr(triton.next_power_of_2(_LOG_CLASSES))
TABLES = 4  # per program: Q_sel's partner sums (q', u), then E2's
# The vocabulary block: a program keeps about ten [BLOCK_V] float64 arrays live in its
# passes (accumulators, D, q', u, classes), so a smaller block than the other verify
# kernels' (MAX_BLOCK_V) keeps them in registers; the best value is a GPU measurement.
MAX_WOR_BLOCK_V = 1024
LEVEL, DRAW = tl.constexpr(0), tl.constexpr(1)


@triton.jit
def _log_class(ratio):
    # Positive finite ratios -> class 1 .. NUM_CLASSES - 2 (univer_wor._log_class).
    octave = (tl.log2(ratio) + HALF_OCTAVES) * CLASSES_PER_OCTAVE
    return tl.minimum(tl.maximum(tl.floor(octave), 0.0), NUM_CLASSES - 3).to(tl.int32) + 1


@triton.jit
def _classes(d, q, floor_class):
    # log_ratio_classes: the class of D / q', at least ``floor_class``; q' = 0: the top class.
    positive = (d > 0) & (q > 0)
    c = tl.where(positive, _log_class(tl.where(positive, d / tl.where(positive, q, 1.0), 1.0)), 0)
    return tl.where(q <= 0, NUM_CLASSES - 1, tl.maximum(c, floor_class))


@triton.jit
def _inputs(p_row, q_row, idx, mask, scale):
    # D = P~ p, q', u = q' / (1 - q') (0 where 1 - q' <= 0) at the tokens ``idx``.
    d = scale * tl.load(p_row + idx, mask=mask, other=0.0).to(tl.float64)
    q = tl.load(q_row + idx, mask=mask, other=0.0).to(tl.float64)
    u = tl.where(1.0 - q > 0, q / tl.where(1.0 - q > 0, 1.0 - q, 1.0), 0.0)
    return d, q, u


@triton.jit
def _slot_missed(d, q):
    # [q' - D]+ / (1 - q').
    return tl.where(1.0 - q > 0, tl.maximum(q - d, 0.0) / tl.where(1.0 - q > 0, 1.0 - q, 1.0), 0.0)


@triton.jit
def _slot_left(d, q, slot_missed_total):
    # Slot order at a token: (the second's E2, the leftover after both).
    lone_left = d - tl.minimum(q, d)
    second = tl.maximum(q * (slot_missed_total - _slot_missed(d, q)), 0.0)
    return second, lone_left - tl.minimum(second, lone_left)


@triton.jit
def _table(tab, row, cls, mask):
    # Row ``row`` of the program's class tables at the classes ``cls``. Read past L1 (.cg):
    # the tables were filled by atomic adds, which L1 does not see.
    return tl.load(tab + row * NUM_CLASSES + cls, mask=mask, other=0.0, cache_modifier=".cg")


@triton.jit
def _selected(d, q, u, cls, tab, mask, tie_a):
    # s = min(1, D / Q_sel), D2 = D - min(Q_sel, D), Q_sel's slot-a term. The table rows hold
    # lower + tie * own per class (rows 0, 1: partner factors q', u).
    after0 = _table(tab, 0, cls, mask) - tie_a * q
    after1 = _table(tab, 1, cls, mask) - (1.0 - tie_a) * u
    sel0 = u * after0
    q_sel = tl.maximum(sel0 + q * after1, 0.0)
    return clipped_ratio(d, q_sel), d - tl.minimum(q_sel, d), sel0


@triton.jit
def _by_ratio(d, q, u, cls, tab, mask, tie_a):
    # Selection by ratio at a token: (s, t, leftover, passed to slot a). Rows 2, 3 hold
    # E2's partner sums above the class plus the tie share (total - lower - (1 - tie') own).
    take, left, sel0 = _selected(d, q, u, cls, tab, mask, tie_a)
    before0 = _table(tab, 2, cls, mask) - (1.0 - tie_a) * q * (1.0 - take)
    before1 = _table(tab, 3, cls, mask) - tie_a * u * (1.0 - take)
    e0 = u * before0
    second = tl.maximum(e0 + q * before1, 0.0)
    second_take = clipped_ratio(left, second)
    return take, second_take, left - tl.minimum(second, left), take * sel0 + second_take * e0


@triton.jit
def _prefix_tables(tab, row, tie_row, upper_share):
    # Rows ``row``, ``row`` + 1 of per-class sums -> lower + tie * own (upper_share False) or
    # total - lower - (1 - tie) * own (True), in place; tie_row: the tie shares of the two rows.
    offs = tl.arange(0, CLASS_BLOCK)
    inside = offs < NUM_CLASSES
    tl.debug_barrier()
    for r in tl.static_range(2):
        ptr = tab + (row + r) * NUM_CLASSES + offs
        own = tl.load(ptr, mask=inside, other=0.0, cache_modifier=".cg")
        lower = tl.cumsum(own, axis=0) - own
        tie = tl.sum(tl.where(tl.arange(0, 2) == r, tie_row, 0.0), axis=0)
        if upper_share:
            value = tl.sum(own, axis=0) - lower - (1.0 - tie) * own
        else:
            value = lower + tie * own
        tl.debug_barrier()
        tl.store(ptr, value, mask=inside)
    tl.debug_barrier()


@triton.jit
def _wor_pair_kernel(
    p_ptr,
    q_ptr,
    tokens_ptr,
    nodes_ptr,  # LEVEL: [n] the level's nodes; DRAW: [B] the end node of each request
    children_ptr,
    kid_sizes_ptr,
    weight_ptr,  # [B, N+1] work dtype: read (P~ of the node), written (LEVEL: the children's)
    stop_ptr,  # [B, N+1] work dtype (LEVEL: h of the node)
    uniform_ptr,  # [B] float64 (DRAW)
    next_token_ptr,  # [B] int64 (DRAW)
    scratch_ptr,  # [programs, TABLES, NUM_CLASSES] float64
    stride_pb,
    stride_pn,
    stride_qb,
    stride_qn,
    stride_tb,
    stride_cn,
    stride_wb,
    vocab,
    num_slots,
    MODE: tl.constexpr,
    WEIGHTED: tl.constexpr,  # slots weighed by sqrt(subtree size) (not TreeSpec.even_pairs)
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0)
    if MODE == LEVEL:
        node = tl.load(nodes_ptr + tl.program_id(1))
    else:
        node = tl.load(nodes_ptr + b)
    program = b * tl.num_programs(1) + tl.program_id(1)
    tab = scratch_ptr + program * 4 * NUM_CLASSES
    p_row = p_ptr + b * stride_pb + node * stride_pn
    q_row = q_ptr + b * stride_qb + node * stride_qn
    scale = tl.load(weight_ptr + b * stride_wb + node).to(tl.float64)
    slot, kid, tok = child_slots(children_ptr, tokens_ptr, b, node, stride_tb, stride_cn, num_slots, 2)
    xa = tl.sum(tl.where(slot == 0, tok, 0), axis=0)
    xb = tl.sum(tl.where(slot == 1, tok, 0), axis=0)
    has_a, has_b = xa >= 0, xb >= 0

    # Uneven pairs: ratios floored at w_big / w_small, ties won by the larger subtree.
    tie_a = tl.full((), 0.5, tl.float64)
    floor_class = tl.full((), 0, tl.int32)
    w_a = tl.full((), 1.0, tl.float64)
    w_b = tl.full((), 1.0, tl.float64)
    if WEIGHTED:
        sizes = tl.load(kid_sizes_ptr + node * stride_cn + slot, mask=slot < num_slots, other=0).to(tl.float64)
        w_a = tl.sqrt(tl.sum(tl.where(slot == 0, sizes, 0.0), axis=0))
        w_b = tl.sqrt(tl.sum(tl.where(slot == 1, sizes, 0.0), axis=0))
        uneven = w_a != w_b
        floor = tl.where(uneven, tl.maximum(w_a, w_b) / tl.minimum(w_a, w_b), 0.0)
        floor_class = tl.where(floor > 0, _log_class(tl.where(floor > 0, floor, 1.0)), 0)
        tie_a = tl.where(uneven, tl.where(w_a > w_b, 1.0, 0.0), 0.5)
    tie_row = tl.where(tl.arange(0, 2) == 0, tie_a, 1.0 - tie_a)
    tie_row_missed = tl.where(tl.arange(0, 2) == 0, 1.0 - tie_a, tie_a)

    offs = tl.arange(0, BLOCK_V)
    cls_offs = tl.arange(0, CLASS_BLOCK)
    for r in tl.static_range(4):
        tl.store(tab + r * NUM_CLASSES + cls_offs, tl.zeros([CLASS_BLOCK], tl.float64), mask=cls_offs < NUM_CLASSES)
    tl.debug_barrier()

    # Pass 1: masses per class; the sums the lone and slot-order steps need.
    sigma_acc = tl.zeros([BLOCK_V], dtype=tl.float64)
    law_acc = tl.zeros([BLOCK_V], dtype=tl.float64)
    lone_acc = tl.zeros([BLOCK_V], dtype=tl.float64)
    slot_acc = tl.zeros([BLOCK_V], dtype=tl.float64)
    for start in range(0, vocab, BLOCK_V):
        idx = start + offs
        inside = idx < vocab
        d, q, u = _inputs(p_row, q_row, idx, inside, scale)
        sigma_acc += d
        law_acc += q
        lone_acc += d - tl.minimum(q, d)
        slot_acc += _slot_missed(d, q)
        if has_b:
            cls = _classes(d, q, floor_class)
            tl.atomic_add(tab + cls, q, mask=inside)
            tl.atomic_add(tab + NUM_CLASSES + cls, u, mask=inside)
    sigma = tl.sum(sigma_acc, axis=0)
    rho_lone = tl.sum(lone_acc, axis=0)
    slot_missed = tl.sum(slot_acc, axis=0)
    rho = tl.where(has_a, rho_lone, sigma)
    by_ratio = tl.full((), 0, tl.int1)
    if has_b:
        _prefix_tables(tab, 0, tie_row, False)
        # Pass 2: what the selected child leaves unmet, per class; the slot-order leftover.
        slot_rho_acc = tl.zeros([BLOCK_V], dtype=tl.float64)
        for start in range(0, vocab, BLOCK_V):
            idx = start + offs
            inside = idx < vocab
            d, q, u = _inputs(p_row, q_row, idx, inside, scale)
            cls = _classes(d, q, floor_class)
            take = _selected(d, q, u, cls, tab, inside, tie_a)[0]
            tl.atomic_add(tab + 2 * NUM_CLASSES + cls, q * (1.0 - take), mask=inside)
            tl.atomic_add(tab + 3 * NUM_CLASSES + cls, u * (1.0 - take), mask=inside)
            slot_rho_acc += _slot_left(d, q, slot_missed)[1]
        rho_slot = tl.sum(slot_rho_acc, axis=0)
        _prefix_tables(tab, 2, tie_row_missed, True)
        # Pass 3: the selection's leftover and what it passes to the first slot.
        ratio_rho_acc = tl.zeros([BLOCK_V], dtype=tl.float64)
        first_acc = tl.zeros([BLOCK_V], dtype=tl.float64)
        for start in range(0, vocab, BLOCK_V):
            idx = start + offs
            inside = idx < vocab
            d, q, u = _inputs(p_row, q_row, idx, inside, scale)
            cls = _classes(d, q, floor_class)
            _, _, left, to_first = _by_ratio(d, q, u, cls, tab, inside, tie_a)
            ratio_rho_acc += left
            first_acc += to_first
        rho_ratio = tl.sum(ratio_rho_acc, axis=0)
        gain = rho_slot - rho_ratio  # equal weights: the coupling that leaves less over
        if WEIGHTED:
            gain = gain * w_b + (w_a - w_b) * (tl.sum(first_acc, axis=0) - (sigma - rho_lone))
        by_ratio = gain >= 0
        rho = tl.where(by_ratio, rho_ratio, rho_slot)

    if MODE == LEVEL:
        # The acceptances of the drawn children (univer_wor._Stage._accept).
        d, q, u = _inputs(p_row, q_row, tl.maximum(tok, 0), slot < 2, scale)
        cls = _classes(d, q, floor_class)
        take, second_take, _, _ = _by_ratio(d, q, u, cls, tab, slot < 2, tie_a)
        lone = clipped_ratio(d, q)
        lone_a = tl.sum(tl.where(slot == 0, lone, 0.0), axis=0)
        c_a = tl.sum(tl.where(slot == 0, cls, 0), axis=0)
        c_b = tl.sum(tl.where(slot == 1, cls, 0), axis=0)
        a_wins = tl.where(c_a == c_b, tie_a, tl.where(c_a > c_b, 1.0, 0.0))
        b_wins = 1.0 - a_wins
        take_a = tl.sum(tl.where(slot == 0, take, 0.0), axis=0)
        take_b = tl.sum(tl.where(slot == 1, take, 0.0), axis=0)
        second_a = tl.sum(tl.where(slot == 0, second_take, 0.0), axis=0)
        second_b = tl.sum(tl.where(slot == 1, second_take, 0.0), axis=0)
        ratio_a = a_wins * take_a + b_wins * (1.0 - take_b) * second_a
        ratio_b = b_wins * take_b + a_wins * (1.0 - take_a) * second_b
        second_slot, _ = _slot_left(d, q, slot_missed)
        lone_left = d - tl.minimum(q, d)
        slot_b = (1.0 - lone_a) * tl.sum(tl.where(slot == 1, clipped_ratio(lone_left, second_slot), 0.0), axis=0)
        accept_a = tl.where(has_b & by_ratio, ratio_a, lone_a)
        accept_b = tl.where(by_ratio, ratio_b, slot_b)
        accept_a = tl.where(has_a, accept_a, 0.0)
        accept_b = tl.where(has_b, accept_b, 0.0)
        # Child weights: slot a's acceptance, slot b's given that a did not end the step.
        child = tl.where(slot == 0, accept_a, clipped_ratio(accept_b, 1.0 - accept_a))
        child = tl.where(tok >= 0, child, 0.0)
        tl.store(weight_ptr + b * stride_wb + kid, child.to(weight_ptr.dtype.element_ty), mask=kid >= 0)
        tl.store(stop_ptr + b * stride_wb + node, continue_prob(rho, sigma).to(stop_ptr.dtype.element_ty))
    else:
        # The next token: R's inverse CDF at the uniform (p's where R is empty), two passes in
        # one block order, the last positive token if rounding leaves the target unreached.
        uniform = tl.load(uniform_ptr + b)
        total_acc = tl.zeros([BLOCK_V], dtype=tl.float64)
        p_acc = tl.zeros([BLOCK_V], dtype=tl.float64)
        for start in range(0, vocab, BLOCK_V):
            idx = start + offs
            left, p_blk = _leftover(p_row, q_row, idx, idx < vocab, scale, floor_class, tab, tie_a, slot_missed,
                                    has_a, has_b, by_ratio)  # fmt: skip
            total_acc += left
            p_acc += p_blk
        res_total = tl.sum(total_acc, axis=0)
        use_p = res_total <= 0
        target = uniform * tl.where(use_p, tl.sum(p_acc, axis=0), res_total)
        running = tl.zeros((), dtype=tl.float64)
        found = tl.zeros((), dtype=tl.int32)
        choice = tl.zeros((), dtype=tl.int64)
        last_positive = tl.zeros((), dtype=tl.int64)
        for start in range(0, vocab, BLOCK_V):
            idx = start + offs
            left, p_blk = _leftover(p_row, q_row, idx, idx < vocab, scale, floor_class, tab, tie_a, slot_missed,
                                    has_a, has_b, by_ratio)  # fmt: skip
            w = tl.where(use_p, p_blk, left)
            block_total = tl.sum(w, axis=0)
            crosses = (running + tl.cumsum(w, axis=0) > target) & (w > 0)
            first = tl.min(tl.where(crosses, idx, vocab), axis=0)
            positive_here = tl.max(tl.where(w > 0, idx, -1), axis=0)
            last_positive = tl.where(positive_here >= 0, positive_here.to(tl.int64), last_positive)
            block_holds = (found == 0) & (running + block_total > target)
            choice = tl.where(block_holds, tl.where(first < vocab, first.to(tl.int64), last_positive), choice)
            found = tl.where(block_holds, 1, found)
            running += block_total
        tl.store(next_token_ptr + b, tl.where(found == 1, choice, last_positive))


@triton.jit
def _leftover(p_row, q_row, idx, mask, scale, floor_class, tab, tie_a, slot_missed, has_a, has_b, by_ratio):
    # R at the tokens ``idx`` (univer_wor._Stage.evaluate) and p there.
    d, q, u = _inputs(p_row, q_row, idx, mask, scale)
    lone_left = d - tl.minimum(q, d)
    left = lone_left
    if has_b:
        if by_ratio:
            left = _by_ratio(d, q, u, _classes(d, q, floor_class), tab, mask, tie_a)[2]
        else:
            left = _slot_left(d, q, slot_missed)[1]
    left = tl.where(has_a, left, d)
    return tl.where(mask, left, 0.0), tl.load(p_row + idx, mask=mask, other=0.0).to(tl.float64)


def _launch(mode, p, q, tokens, nodes, tt, weight, stop, uniforms, next_token, grid) -> None:
    batch, _, vocab = p.shape
    children = tt.children
    if children.shape[1] > 2:
        raise ValueError("the fused univer_wor kernel takes trees of at most two children per node")
    scratch = torch.empty(grid[0] * grid[1], TABLES, _LOG_CLASSES, dtype=torch.float64, device=p.device)
    sizes = tt.kid_sizes
    _wor_pair_kernel[grid](
        p, q, tokens, nodes, children, sizes, weight, stop, uniforms, next_token, scratch,
        p.stride(0), p.stride(1), q.stride(0), q.stride(1), tokens.stride(0), children.stride(0), weight.stride(0),
        vocab, children.shape[1],
        MODE=mode, WEIGHTED=not tt.even_pairs, BLOCK_V=min(MAX_WOR_BLOCK_V, block_size(vocab)),
    )  # fmt: skip


def wor_level(p, q, tokens, nodes, tt, weight, stop) -> None:
    """univer_wor's rule at ``nodes`` [n] (one depth level) of every request, in place:
    the children's weights (entry scales) into ``weight`` [B, N+1], h into ``stop``."""
    _launch(LEVEL.value, p, q, tokens, nodes, tt, weight, stop, weight, tokens, (p.shape[0], nodes.numel()))


def wor_draw(p, q, tokens, end, tt, weight, uniforms) -> torch.Tensor:
    """The next token of each request [B] int64: the end node's residual R (``end`` [B]; its
    entry scale in ``weight`` [B, N+1]) drawn by inverse CDF at ``uniforms`` [B] float64."""
    next_token = torch.empty(p.shape[0], dtype=torch.int64, device=p.device)
    _launch(DRAW.value, p, q, tokens, end, tt, weight, weight, uniforms, next_token, (p.shape[0], 1))
    return next_token
