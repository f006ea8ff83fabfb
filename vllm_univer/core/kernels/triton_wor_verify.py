"""Triton kernels: ``univer_wor``'s node rule, one launch per depth level (two in
trees where its three-child stage may run), and the draw of the next token at
the end node in one (two) more (the CUDA path of ``verify``), for trees of at
most four children per node.

The PyTorch rule (``verifiers/univer_wor.py``) issues ~300 ATen ops per level,
each a kernel launch on CUDA (~1 550 per ``verify`` on a 2x5 tree). Here one
program per (request, node) runs the node's pair stages, children 1-2 and then,
for three or four children, 3-4 against stage 1's leftover (its demand and law
recomputed per token from stage 1's tables). A stage is

    pass 1   sigma, sum q', sum [D - q']+, sum [q' - D]+ / (1 - q'); q' and
             u = q' / (1 - q') added per ratio class into the program's tables
    tables   Q_sel's partner sums per class (prefix sums + the tie share)
    pass 2   s = min(1, D / Q_sel), (1 - s) q' and (1 - s) u per class; the
             slot order's leftover
    tables   E2's partner sums per class
    pass 3   the selection's leftover and what it passes to slot a

then the choice between selection by ratio and slot order and the acceptances
of its two drawn children; h from the last stage. ``_wor_triple_kernel`` runs
beside it on the same nodes and does the nodes that take the three-child stage
(three leaves, all drawn; the pair kernel skips them): x3 tried first, the
pair, x3 again (``_FirstOfThree``, the pair stage, ``_LastOfThree``). The formulas, the log-scale
ratio classes (with the uneven pairs' floor and tie rule) and their order are
the PyTorch rule's; every value is computed in float64. The draw recomputes the
end node's stages with the same code (so its residual R is that of the weights
written) and then takes R's inverse CDF at the step's uniform in two more passes.

Vocabularies up to ``EXACT_RANK_VOCAB`` (where the PyTorch rule compares exact
ratio ranks) and trees of five or more children per node stay on the PyTorch
rule (``fused_tree_pass.fused_refusal``).

Per program and pair stage the class tables take 4 x 2050 floats of scratch
(the three-child stage 12 x 2050; global memory, zeroed by the program); the
histograms are built with atomic adds.
Tensors: p, q [B, N+1, V] (last dim contiguous; float32, bfloat16 or float64);
tokens [B, N+1] int64 (-1: missing); children, kid_sizes [N+1, C] int64, C <= 4.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..verifiers.univer_wor import _CLASSES_PER_OCTAVE, _LOG_CLASSES, _OCTAVES
from .checks import expect, expect_tree_rows
from .triton_rows import block_size, child_slots, clipped_ratio, inverse_cdf_step, stop_prob

NUM_CLASSES = tl.constexpr(_LOG_CLASSES)
CLASSES_PER_OCTAVE = tl.constexpr(float(_CLASSES_PER_OCTAVE))
HALF_OCTAVES = tl.constexpr(float(_OCTAVES // 2))
CLASS_BLOCK = tl.constexpr(triton.next_power_of_2(_LOG_CLASSES))
TABLES = 4  # per program and pair stage: Q_sel's partner sums (q', u), then E2's
TINY = tl.constexpr(torch.finfo(torch.float64).tiny)  # univer_wor._LaterInputs' floor of the renormaliser
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
    # Clamped as integers: the class indexes the tables, and rows holding NaN or inf (which
    # verify's validation rejects) must never address outside them.
    positive = (d > 0) & (q > 0)
    c = tl.where(positive, _log_class(tl.where(positive, d / tl.where(positive, q, 1.0), 1.0)), 0)
    c = tl.where(q <= 0, NUM_CLASSES - 1, tl.maximum(c, floor_class))
    return tl.minimum(tl.maximum(c, 0), NUM_CLASSES - 1)


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
def _add_per_class(tab, cls, q_part, u_part, mask):
    # Rows 0 and 1 of the tables at ``tab``: q_part and u_part added at their tokens' classes.
    tl.atomic_add(tab + cls, q_part, mask=mask)
    tl.atomic_add(tab + NUM_CLASSES + cls, u_part, mask=mask)


@triton.jit
def _add_low_class(tab, floor_class, low_q, low_u):
    # The lowest class (every ratio at or below the floor, D = 0 included: with top-k / top-p
    # most of the vocabulary) summed in registers, then added once: atomics on one address
    # run one after another. Tokens with q' = 0 (u = 0) add nothing and are skipped.
    tl.atomic_add(tab + floor_class, tl.sum(low_q, axis=0))
    tl.atomic_add(tab + NUM_CLASSES + floor_class, tl.sum(low_u, axis=0))


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
def _pair_left(d, q, u, cls, tab, mask, tie_a, slot_missed, has_a, has_b, by_ratio):
    # A stage's leftover R at tokens with inputs (d, q', u) and classes ``cls``
    # (univer_wor._Stage.evaluate).
    left = d - tl.minimum(q, d)
    if has_b:
        if by_ratio:
            left = _by_ratio(d, q, u, cls, tab, mask, tie_a)[2]
        else:
            left = _slot_left(d, q, slot_missed)[1]
    return tl.where(has_a, left, d)


@triton.jit
def _row_inputs(p_row, q_row, idx, inside, scale):
    # D = P~ p (0 off the vocabulary) and q' at the tokens ``idx``.
    d = tl.where(inside, scale * tl.load(p_row + idx, mask=inside, other=0.0).to(tl.float64), 0.0)
    return d, tl.load(q_row + idx, mask=inside, other=0.0).to(tl.float64)


@triton.jit
def _takes_three_child_stage(slot, sizes, tok):
    # Whether a node of a tree with at most three children per node runs the three-child
    # stage: three leaf children (subtree sizes 1), all drawn (univer_wor's use_triple).
    return tl.sum(tl.where((slot < 3) & ((sizes != 1) | (tok < 0)), 1, 0), axis=0) == 0


@triton.jit
def _stage_inputs(p_row, q_row, idx, mask, scale, STAGE: tl.constexpr, first, drawn_a, drawn_b, reached, norm):
    # The stage's demand D, law q' and u = q' / (1 - q') at the tokens ``idx``. Stage 2
    # (children 3-4, univer_wor._LaterInputs): stage 1's leftover as a density given that
    # stage 2 is reached, and q off stage 1's drawn tokens, renormalised. ``first``: stage 1's
    # (tables, floor class, tie_a, slot-order sum, has_a, has_b, by_ratio).
    d, q = _row_inputs(p_row, q_row, idx, mask, scale)
    if STAGE == 2:
        tab, floor_class, tie_a, slot_missed, has_a, has_b, by_ratio = first
        u = tl.where(1.0 - q > 0, q / tl.where(1.0 - q > 0, 1.0 - q, 1.0), 0.0)
        left = _pair_left(d, q, u, _classes(d, q, floor_class), tab, mask, tie_a, slot_missed, has_a, has_b, by_ratio)
        d = tl.where(reached > 0, left / tl.where(reached > 0, reached, 1.0), 0.0)
        q = tl.where((idx == drawn_a) | (idx == drawn_b), 0.0, q) / norm
    u = tl.where(1.0 - q > 0, q / tl.where(1.0 - q > 0, 1.0 - q, 1.0), 0.0)
    return d, q, u


@triton.jit
def _stage(
    p_row,
    q_row,
    vocab,
    scale,
    tab,
    has_a,
    has_b,
    size_a,
    size_b,
    STAGE: tl.constexpr,
    WEIGHTED: tl.constexpr,
    BLOCK_V: tl.constexpr,
    first,
    drawn_a,
    drawn_b,
    reached,
    norm,
):
    # One pair stage's passes (univer_wor._Stage): -> (sigma, law mass, rho, slot-order sum,
    # by_ratio, floor class, tie_a); its class tables left in ``tab`` (rows 0-3).
    # Uneven pairs: ratios floored at w_big / w_small, ties won by the larger subtree.
    tie_a = tl.full((), 0.5, tl.float64)
    floor_class = tl.full((), 0, tl.int32)
    w_a = tl.sqrt(size_a)
    w_b = tl.sqrt(size_b)
    if WEIGHTED:
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
    low_q = tl.zeros([BLOCK_V], dtype=tl.float64)
    low_u = tl.zeros([BLOCK_V], dtype=tl.float64)
    for start in range(0, vocab, BLOCK_V):
        idx = start + offs
        inside = idx < vocab
        d, q, u = _stage_inputs(p_row, q_row, idx, inside, scale, STAGE, first, drawn_a, drawn_b, reached, norm)
        sigma_acc += d
        law_acc += q
        lone_acc += d - tl.minimum(q, d)
        slot_acc += _slot_missed(d, q)
        if has_b:
            cls = _classes(d, q, floor_class)
            low = cls == floor_class
            low_q += tl.where(inside & low, q, 0.0)
            low_u += tl.where(inside & low, u, 0.0)
            _add_per_class(tab, cls, q, u, inside & (q > 0) & ~low)
    if has_b:
        _add_low_class(tab, floor_class, low_q, low_u)
    sigma = tl.sum(sigma_acc, axis=0)
    rho_lone = tl.sum(lone_acc, axis=0)
    slot_missed = tl.sum(slot_acc, axis=0)
    rho = tl.where(has_a, rho_lone, sigma)
    by_ratio = tl.full((), 0, tl.int1)
    if has_b:
        _prefix_tables(tab, 0, tie_row, False)
        # Pass 2: what the selected child leaves unmet, per class; the slot-order leftover.
        slot_rho_acc = tl.zeros([BLOCK_V], dtype=tl.float64)
        low_q = tl.zeros([BLOCK_V], dtype=tl.float64)
        low_u = tl.zeros([BLOCK_V], dtype=tl.float64)
        for start in range(0, vocab, BLOCK_V):
            idx = start + offs
            inside = idx < vocab
            d, q, u = _stage_inputs(p_row, q_row, idx, inside, scale, STAGE, first, drawn_a, drawn_b, reached, norm)
            cls = _classes(d, q, floor_class)
            take = _selected(d, q, u, cls, tab, inside, tie_a)[0]
            missed_q, missed_u = q * (1.0 - take), u * (1.0 - take)
            low = cls == floor_class
            low_q += tl.where(inside & low, missed_q, 0.0)
            low_u += tl.where(inside & low, missed_u, 0.0)
            _add_per_class(tab + 2 * NUM_CLASSES, cls, missed_q, missed_u, inside & (missed_q > 0) & ~low)
            slot_rho_acc += _slot_left(d, q, slot_missed)[1]
        _add_low_class(tab + 2 * NUM_CLASSES, floor_class, low_q, low_u)
        rho_slot = tl.sum(slot_rho_acc, axis=0)
        _prefix_tables(tab, 2, tie_row_missed, True)
        # Pass 3: the selection's leftover and what it passes to the first slot.
        ratio_rho_acc = tl.zeros([BLOCK_V], dtype=tl.float64)
        first_acc = tl.zeros([BLOCK_V], dtype=tl.float64)
        for start in range(0, vocab, BLOCK_V):
            idx = start + offs
            inside = idx < vocab
            d, q, u = _stage_inputs(p_row, q_row, idx, inside, scale, STAGE, first, drawn_a, drawn_b, reached, norm)
            cls = _classes(d, q, floor_class)
            _, _, left, to_first = _by_ratio(d, q, u, cls, tab, inside, tie_a)
            ratio_rho_acc += tl.where(inside, left, 0.0)
            first_acc += tl.where(inside, to_first, 0.0)
        rho_ratio = tl.sum(ratio_rho_acc, axis=0)
        gain = rho_slot - rho_ratio  # equal weights: the coupling that leaves less over
        if WEIGHTED:
            gain = gain * w_b + (w_a - w_b) * (tl.sum(first_acc, axis=0) - (sigma - rho_lone))
        by_ratio = gain >= 0
        rho = tl.where(by_ratio, rho_ratio, rho_slot)
    return sigma, tl.sum(law_acc, axis=0), rho, slot_missed, by_ratio, floor_class, tie_a


@triton.jit
def _accept(d, q, u, cls, pair, tab, tie_a, slot_missed, has_a, has_b, by_ratio):
    # The chance that each of a stage's two children (inputs d, q', u, classes ``cls`` at
    # its tokens; ``pair`` = arange(2)) has its subtree entered (univer_wor._Stage._accept).
    take, second_take, _, _ = _by_ratio(d, q, u, cls, tab, pair < 2, tie_a)
    lone_a = tl.sum(tl.where(pair == 0, clipped_ratio(d, q), 0.0), axis=0)
    c_a = tl.sum(tl.where(pair == 0, cls, 0), axis=0)
    c_b = tl.sum(tl.where(pair == 1, cls, 0), axis=0)
    a_wins = tl.where(c_a == c_b, tie_a, tl.where(c_a > c_b, 1.0, 0.0))
    b_wins = 1.0 - a_wins
    take_a = tl.sum(tl.where(pair == 0, take, 0.0), axis=0)
    take_b = tl.sum(tl.where(pair == 1, take, 0.0), axis=0)
    second_a = tl.sum(tl.where(pair == 0, second_take, 0.0), axis=0)
    second_b = tl.sum(tl.where(pair == 1, second_take, 0.0), axis=0)
    ratio_a = a_wins * take_a + b_wins * (1.0 - take_b) * second_a
    ratio_b = b_wins * take_b + a_wins * (1.0 - take_a) * second_b
    second_slot, _ = _slot_left(d, q, slot_missed)
    lone_left = d - tl.minimum(q, d)
    slot_b = (1.0 - lone_a) * tl.sum(tl.where(pair == 1, clipped_ratio(lone_left, second_slot), 0.0), axis=0)
    accept_a = tl.where(has_a, tl.where(has_b & by_ratio, ratio_a, lone_a), 0.0)
    accept_b = tl.where(has_b, tl.where(by_ratio, ratio_b, slot_b), 0.0)
    return accept_a, accept_b


@triton.jit
def _slot_value(vec, slot, k):
    return tl.sum(tl.where(slot == k, vec, 0), axis=0)


@triton.jit
def _wor_pair_kernel(
    p_ptr,  # [B, N+1, V] target rows p (any float dtype, V contiguous)
    q_ptr,  # [B, N+1, V] draft rows q: what each node's children were drawn from
    tokens_ptr,  # [B, N+1] int64 draft tokens (-1: the node does not exist)
    nodes_ptr,  # LEVEL: [n] the level's nodes; DRAW: [B] the end node of each request
    children_ptr,  # [N+1, C] int64: each node's children in slot order, -1 padded
    kid_sizes_ptr,  # [N+1, C] int64: nodes in each child slot's subtree, 0 where none
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
    vocab,  # V
    num_slots,  # C: child slots per node
    MODE: tl.constexpr,
    STAGES: tl.constexpr,  # 1: at most two children per node; 2: three or four (two pair stages)
    WEIGHTED: tl.constexpr,  # slots weighed by sqrt(subtree size) (not TreeSpec.even_pairs)
    THREE_CHILD_STAGE: tl.constexpr,  # nodes taking it are left to _wor_triple_kernel
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0)
    if MODE == LEVEL:
        node = tl.load(nodes_ptr + tl.program_id(1))
    else:
        node = tl.load(nodes_ptr + b)
    program = b * tl.num_programs(1) + tl.program_id(1)
    tab = scratch_ptr + program * (4 * STAGES) * NUM_CLASSES
    p_row = p_ptr + b * stride_pb + node * stride_pn
    q_row = q_ptr + b * stride_qb + node * stride_qn
    scale = tl.load(weight_ptr + b * stride_wb + node).to(tl.float64)
    slot, kid, tok = child_slots(children_ptr, tokens_ptr, b, node, stride_tb, stride_cn, num_slots, 2 * STAGES)
    sizes = tl.load(kid_sizes_ptr + node * stride_cn + slot, mask=slot < num_slots, other=0).to(tl.float64)
    if THREE_CHILD_STAGE:
        if _takes_three_child_stage(slot, sizes, tok):
            return  # _wor_triple_kernel writes this node's outputs
    x1, x2 = _slot_value(tok, slot, 0), _slot_value(tok, slot, 1)
    pair = tl.arange(0, 2)
    zero = tl.zeros((), tl.float64)

    # Stage 1: children 1-2 against D = P~ p and q.
    none = (tab, 0, zero, zero, x1 >= 0, x2 >= 0, x1 < 0)  # stage 1 reads no earlier stage
    sigma, law_mass, rho, slot_missed, by_ratio, floor_class, tie_a = _stage(
        p_row,
        q_row,
        vocab,
        scale,
        tab,
        x1 >= 0,
        x2 >= 0,
        _slot_value(sizes, slot, 0),
        _slot_value(sizes, slot, 1),
        1,
        WEIGHTED,
        BLOCK_V,
        none,
        -1,
        -1,
        zero,
        zero,
    )
    first = (tab, floor_class, tie_a, slot_missed, x1 >= 0, x2 >= 0, by_ratio)
    if MODE == LEVEL:
        tok_ab = tl.where(pair == 0, x1, x2)
        d, q, u = _stage_inputs(p_row, q_row, tl.maximum(tok_ab, 0), pair < 2, scale, 1, none, -1, -1, zero, zero)
        accept_a, accept_b = _accept(
            d, q, u, _classes(d, q, floor_class), pair, tab, tie_a, slot_missed, x1 >= 0, x2 >= 0, by_ratio
        )
        # Child weights: a slot's acceptance, given that no earlier slot's subtree ended the step.
        child = tl.where(slot == 0, accept_a, clipped_ratio(accept_b, 1.0 - accept_a))
    stage_tab, stage_args = tab, first
    drawn_a, drawn_b, reached, norm = -1, -1, zero, zero
    if STAGES == 2:
        # Stage 2: children 3-4, given stage 1's draws and that it passed them on.
        x3, x4 = _slot_value(tok, slot, 2), _slot_value(tok, slot, 3)
        law_at = tl.load(q_row + tl.maximum(tl.where(pair == 0, x1, x2), 0)).to(tl.float64)
        law_at = tl.sum(tl.where(tl.where(pair == 0, x1, x2) >= 0, law_at, 0.0), axis=0)
        norm = tl.maximum(law_mass - law_at, TINY)
        reached = tl.maximum(1.0 - (sigma - rho), 0.0)
        drawn_a, drawn_b = x1, x2
        stage_tab = tab + 4 * NUM_CLASSES
        sigma, law_mass, rho, slot_missed, by_ratio, floor_class, tie_a = _stage(
            p_row,
            q_row,
            vocab,
            scale,
            stage_tab,
            x3 >= 0,
            x4 >= 0,
            _slot_value(sizes, slot, 2),
            _slot_value(sizes, slot, 3),
            2,
            WEIGHTED,
            BLOCK_V,
            first,
            drawn_a,
            drawn_b,
            reached,
            norm,
        )
        stage_args = (stage_tab, floor_class, tie_a, slot_missed, x3 >= 0, x4 >= 0, by_ratio)
        if MODE == LEVEL:
            tok_cd = tl.where(pair == 0, x3, x4)
            d, q, u = _stage_inputs(
                p_row, q_row, tl.maximum(tok_cd, 0), pair < 2, scale, 2, first, drawn_a, drawn_b, reached, norm
            )
            accept_c, accept_d = _accept(
                d, q, u, _classes(d, q, floor_class), pair, stage_tab, tie_a, slot_missed, x3 >= 0, x4 >= 0, by_ratio
            )
            child = tl.where(slot == 2, accept_c, tl.where(slot == 3, clipped_ratio(accept_d, 1.0 - accept_c), child))

    if MODE == LEVEL:
        child = tl.where(tok >= 0, child, 0.0)
        tl.store(weight_ptr + b * stride_wb + kid, child.to(weight_ptr.dtype.element_ty), mask=kid >= 0)
        tl.store(stop_ptr + b * stride_wb + node, stop_prob(rho, sigma).to(stop_ptr.dtype.element_ty))
    else:
        # The next token: the last stage's R at its inverse CDF at the uniform (p's where R is
        # empty), two passes in one block order, the last positive token if rounding leaves the
        # target unreached.
        last_tab, last_floor, last_tie, last_missed, last_a, last_b, last_by = stage_args
        offs = tl.arange(0, BLOCK_V)
        uniform = tl.load(uniform_ptr + b)
        total_acc = tl.zeros([BLOCK_V], dtype=tl.float64)
        p_acc = tl.zeros([BLOCK_V], dtype=tl.float64)
        for start in range(0, vocab, BLOCK_V):
            idx = start + offs
            inside = idx < vocab
            d, q, u = _stage_inputs(p_row, q_row, idx, inside, scale, STAGES, first, drawn_a, drawn_b, reached, norm)
            left = _pair_left(
                d, q, u, _classes(d, q, last_floor), last_tab, inside, last_tie, last_missed, last_a, last_b, last_by
            )
            total_acc += tl.where(inside, left, 0.0)
            p_acc += tl.load(p_row + idx, mask=inside, other=0.0).to(tl.float64)
        res_total = tl.sum(total_acc, axis=0)
        use_p = res_total <= 0
        target = uniform * tl.where(use_p, tl.sum(p_acc, axis=0), res_total)
        running = tl.zeros((), dtype=tl.float64)
        found = tl.zeros((), dtype=tl.int32)
        choice = tl.zeros((), dtype=tl.int64)
        last_positive = tl.zeros((), dtype=tl.int64)
        for start in range(0, vocab, BLOCK_V):
            idx = start + offs
            inside = idx < vocab
            d, q, u = _stage_inputs(p_row, q_row, idx, inside, scale, STAGES, first, drawn_a, drawn_b, reached, norm)
            left = _pair_left(
                d, q, u, _classes(d, q, last_floor), last_tab, inside, last_tie, last_missed, last_a, last_b, last_by
            )
            p_blk = tl.load(p_row + idx, mask=inside, other=0.0).to(tl.float64)
            w = tl.where(use_p, p_blk, tl.where(inside, left, 0.0))
            running, found, choice, last_positive = inverse_cdf_step(
                w, idx, vocab, target, running, found, choice, last_positive
            )
        tl.store(next_token_ptr + b, tl.where(found == 1, choice, last_positive))


# ---------------------------------------------------------------- the three-child stage
# univer_wor's _FirstOfThree / pair / _LastOfThree at nodes above three leaves with all
# three children drawn (in trees of at most three children). Tables (rows of NUM_CLASSES):
#   0  pairs below the class: sum_{a != b below k} w_a u_b     (rows 1, 2: its sums' scratch)
#   3  G(k): the mass of the classes above k taken first
#   4-7   the pair stage's partner sums (q', u, u, w): lower + own / 2 per class
#   8-11  what the selected child leaves unmet, the same rows: total - lower - own / 2
TRIPLE_TABLES = tl.constexpr(12)


@triton.jit
def _u_w(q):
    # u = q' / (1 - q'), w = u / (1 - q') (0 where 1 - q' <= 0).
    one_minus = 1.0 - q
    safe = tl.where(one_minus > 0, one_minus, 1.0)
    return tl.where(one_minus > 0, q / safe, 0.0), tl.where(one_minus > 0, q / safe / safe, 0.0)


@triton.jit
def _first_take(d, q, cls, tab, mask):
    # x3 tried first: t = min(1, D / E_A), E_A = q' (pairs below y's class); D_A = D - min(E_A, D).
    first = q * _table(tab, 0, cls, mask)
    return clipped_ratio(d, first), d - tl.minimum(first, d)


@triton.jit
def _triple_pair(d_a, q, cls, tab, mask):
    # The pair stage after x3 maybe went first, at tokens with its demand D_A: (s, t, leftover).
    u, w = _u_w(q)
    g = _table(tab, 3, cls, mask)  # G at y's class: x3 taken first above the pair
    after0 = _table(tab, 4, cls, mask) - 0.5 * q
    after1 = _table(tab, 5, cls, mask) - 0.5 * u
    after2 = _table(tab, 6, cls, mask) - 0.5 * u
    after3 = _table(tab, 7, cls, mask) - 0.5 * w
    q_sel = tl.maximum(u * after0 + q * after1 - g * w * after2 - g * u * after3, 0.0)
    take = clipped_ratio(d_a, q_sel)
    left = d_a - tl.minimum(q_sel, d_a)
    missed = 1.0 - take
    before0 = _table(tab, 8, cls, mask) - 0.5 * q * missed
    before1 = _table(tab, 9, cls, mask) - 0.5 * u * missed
    before2 = _table(tab, 10, cls, mask) - 0.5 * u * missed * g
    before3 = _table(tab, 11, cls, mask) - 0.5 * w * missed * g
    second = tl.maximum(u * before0 + q * before1 - w * before2 - u * before3, 0.0)
    second_take = clipped_ratio(left, second)
    return take, second_take, left - tl.minimum(second, left)


@triton.jit
def _triple_last(d, q, cls, tab, mask, idx, x1, x2, top, spread, norm, reached):
    # x3's second chance after the pair: (its demand, its law) at tokens (univer_wor._LastOfThree).
    d_a = _first_take(d, q, cls, tab, mask)[1]
    left = _triple_pair(d_a, q, cls, tab, mask)[2]
    demand = tl.where(reached > 0, left / tl.where(reached > 0, reached, 1.0), 0.0)
    law = tl.where((idx == x1) | (idx == x2), 0.0, q * (spread - tl.where(cls > top, 1.0, 0.0)))
    law = tl.maximum(law, 0.0)
    law = tl.where(norm > 0, law / tl.where(norm > 0, norm, 1.0), 0.0)
    return tl.where(mask, demand, 0.0), tl.where(mask, law, 0.0)


@triton.jit
def _wor_triple_kernel(
    p_ptr,  # [B, N+1, V] target rows p (any float dtype, V contiguous)
    q_ptr,  # [B, N+1, V] draft rows q: what each node's children were drawn from
    tokens_ptr,  # [B, N+1] int64 draft tokens (-1: the node does not exist)
    nodes_ptr,  # LEVEL: [n] the level's nodes; DRAW: [B] the end node of each request
    children_ptr,  # [N+1, C] int64: each node's children in slot order, -1 padded
    kid_sizes_ptr,  # [N+1, C] int64: nodes in each child slot's subtree, 0 where none
    weight_ptr,  # [B, N+1] work dtype: read (P~ of the node), written (LEVEL: the children's)
    stop_ptr,  # [B, N+1] work dtype (LEVEL: h of the node)
    uniform_ptr,  # [B] float64 (DRAW)
    next_token_ptr,  # [B] int64 (DRAW)
    scratch_ptr,  # [programs, TRIPLE_TABLES, NUM_CLASSES] float64
    stride_pb,
    stride_pn,
    stride_qb,
    stride_qn,
    stride_tb,
    stride_cn,
    stride_wb,
    vocab,  # V
    MODE: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # Runs with _wor_pair_kernel on the same nodes and writes the outputs of those that take
    # the three-child stage (all three children leaves and drawn), which that kernel skips.
    b = tl.program_id(0)
    if MODE == LEVEL:
        node = tl.load(nodes_ptr + tl.program_id(1))
    else:
        node = tl.load(nodes_ptr + b)
    slot, kid, tok = child_slots(children_ptr, tokens_ptr, b, node, stride_tb, stride_cn, 3, 4)
    sizes = tl.load(kid_sizes_ptr + node * stride_cn + slot, mask=slot < 3, other=1)
    if _takes_three_child_stage(slot, sizes, tok):
        program = b * tl.num_programs(1) + tl.program_id(1)
        tab = scratch_ptr + program * TRIPLE_TABLES * NUM_CLASSES
        p_row = p_ptr + b * stride_pb + node * stride_pn
        q_row = q_ptr + b * stride_qb + node * stride_qn
        scale = tl.load(weight_ptr + b * stride_wb + node).to(tl.float64)
        x1, x2, x3 = _slot_value(tok, slot, 0), _slot_value(tok, slot, 1), _slot_value(tok, slot, 2)
        offs = tl.arange(0, BLOCK_V)
        cls_offs = tl.arange(0, CLASS_BLOCK)
        in_table = cls_offs < NUM_CLASSES
        for r in tl.static_range(TRIPLE_TABLES):
            tl.store(tab + r * NUM_CLASSES + cls_offs, tl.zeros([CLASS_BLOCK], tl.float64), mask=in_table)
        tl.debug_barrier()

        # x3 first, pass 1: sums of u, w and w u per class -> pairs below each class.
        # Class 0 (D = 0: most of the vocabulary under top-k / top-p) is summed in registers
        # and added once, here and in the pair's passes (_add_low_class's reason).
        sigma_acc = tl.zeros([BLOCK_V], dtype=tl.float64)
        low_0 = tl.zeros([BLOCK_V], dtype=tl.float64)
        low_1 = tl.zeros([BLOCK_V], dtype=tl.float64)
        low_2 = tl.zeros([BLOCK_V], dtype=tl.float64)
        for start in range(0, vocab, BLOCK_V):
            idx = start + offs
            inside = idx < vocab
            d, q = _row_inputs(p_row, q_row, idx, inside, scale)
            u, w = _u_w(q)
            cls = _classes(d, q, 0)
            sigma_acc += d
            low = inside & (cls == 0)
            low_0 += tl.where(low, u, 0.0)
            low_1 += tl.where(low, w, 0.0)
            low_2 += tl.where(low, w * u, 0.0)
            add = inside & (q > 0) & (cls != 0)
            tl.atomic_add(tab + cls, u, mask=add)
            tl.atomic_add(tab + NUM_CLASSES + cls, w, mask=add)
            tl.atomic_add(tab + 2 * NUM_CLASSES + cls, w * u, mask=add)
        tl.atomic_add(tab, tl.sum(low_0, axis=0))
        tl.atomic_add(tab + NUM_CLASSES, tl.sum(low_1, axis=0))
        tl.atomic_add(tab + 2 * NUM_CLASSES, tl.sum(low_2, axis=0))
        sigma_first = tl.sum(sigma_acc, axis=0)
        tl.debug_barrier()
        below_u = tl.load(tab + cls_offs, mask=in_table, other=0.0, cache_modifier=".cg")
        below_w = tl.load(tab + NUM_CLASSES + cls_offs, mask=in_table, other=0.0, cache_modifier=".cg")
        below_wu = tl.load(tab + 2 * NUM_CLASSES + cls_offs, mask=in_table, other=0.0, cache_modifier=".cg")
        below_u = tl.cumsum(below_u, axis=0) - below_u
        below_w = tl.cumsum(below_w, axis=0) - below_w
        below_wu = tl.cumsum(below_wu, axis=0) - below_wu
        tl.debug_barrier()
        tl.store(tab + cls_offs, tl.maximum(below_u * below_w - below_wu, 0.0), mask=in_table)
        tl.debug_barrier()
        # Pass 2: G(k), the mass of the classes above k taken first.
        for start in range(0, vocab, BLOCK_V):
            idx = start + offs
            inside = idx < vocab
            d, q = _row_inputs(p_row, q_row, idx, inside, scale)
            cls = _classes(d, q, 0)
            taken = q * _first_take(d, q, cls, tab, inside)[0]
            tl.atomic_add(tab + 3 * NUM_CLASSES + cls, taken, mask=inside & (taken > 0))
        tl.debug_barrier()
        taken = tl.load(tab + 3 * NUM_CLASSES + cls_offs, mask=in_table, other=0.0, cache_modifier=".cg")
        tl.debug_barrier()
        tl.store(tab + 3 * NUM_CLASSES + cls_offs, tl.sum(taken, axis=0) - tl.cumsum(taken, axis=0), mask=in_table)
        tl.debug_barrier()

        # The pair (x1, x2) on D_A (always by ratio: slot order would need the third draw),
        # pass 1: partner sums (q', u, u, w) per class.
        low_0 = tl.zeros([BLOCK_V], dtype=tl.float64)
        low_1 = tl.zeros([BLOCK_V], dtype=tl.float64)
        low_2 = tl.zeros([BLOCK_V], dtype=tl.float64)
        for start in range(0, vocab, BLOCK_V):
            idx = start + offs
            inside = idx < vocab
            d, q = _row_inputs(p_row, q_row, idx, inside, scale)
            cls = _classes(d, q, 0)
            u, w = _u_w(q)
            low = inside & (cls == 0)
            low_0 += tl.where(low, q, 0.0)
            low_1 += tl.where(low, u, 0.0)
            low_2 += tl.where(low, w, 0.0)
            add = inside & (q > 0) & (cls != 0)
            tl.atomic_add(tab + 4 * NUM_CLASSES + cls, q, mask=add)
            tl.atomic_add(tab + 5 * NUM_CLASSES + cls, u, mask=add)
            tl.atomic_add(tab + 6 * NUM_CLASSES + cls, u, mask=add)
            tl.atomic_add(tab + 7 * NUM_CLASSES + cls, w, mask=add)
        tl.atomic_add(tab + 4 * NUM_CLASSES, tl.sum(low_0, axis=0))
        tl.atomic_add(tab + 5 * NUM_CLASSES, tl.sum(low_1, axis=0))
        tl.atomic_add(tab + 6 * NUM_CLASSES, tl.sum(low_1, axis=0))
        tl.atomic_add(tab + 7 * NUM_CLASSES, tl.sum(low_2, axis=0))
        half = tl.full([2], 0.5, tl.float64)
        _prefix_tables(tab, 4, half, False)
        _prefix_tables(tab, 6, half, False)
        # Pass 2: what the selected child leaves unmet, per class (rows 2-3 times G).
        low_0 = tl.zeros([BLOCK_V], dtype=tl.float64)
        low_1 = tl.zeros([BLOCK_V], dtype=tl.float64)
        low_2 = tl.zeros([BLOCK_V], dtype=tl.float64)
        low_3 = tl.zeros([BLOCK_V], dtype=tl.float64)
        for start in range(0, vocab, BLOCK_V):
            idx = start + offs
            inside = idx < vocab
            d, q = _row_inputs(p_row, q_row, idx, inside, scale)
            cls = _classes(d, q, 0)
            d_a = _first_take(d, q, cls, tab, inside)[1]
            take = _triple_pair(d_a, q, cls, tab, inside)[0]
            u, w = _u_w(q)
            missed = 1.0 - take
            g = _table(tab, 3, cls, inside)
            low = inside & (cls == 0)
            low_0 += tl.where(low, q * missed, 0.0)
            low_1 += tl.where(low, u * missed, 0.0)
            low_2 += tl.where(low, u * missed * g, 0.0)
            low_3 += tl.where(low, w * missed * g, 0.0)
            add = inside & (q > 0) & (missed > 0) & (cls != 0)
            tl.atomic_add(tab + 8 * NUM_CLASSES + cls, q * missed, mask=add)
            tl.atomic_add(tab + 9 * NUM_CLASSES + cls, u * missed, mask=add)
            tl.atomic_add(tab + 10 * NUM_CLASSES + cls, u * missed * g, mask=add)
            tl.atomic_add(tab + 11 * NUM_CLASSES + cls, w * missed * g, mask=add)
        tl.atomic_add(tab + 8 * NUM_CLASSES, tl.sum(low_0, axis=0))
        tl.atomic_add(tab + 9 * NUM_CLASSES, tl.sum(low_1, axis=0))
        tl.atomic_add(tab + 10 * NUM_CLASSES, tl.sum(low_2, axis=0))
        tl.atomic_add(tab + 11 * NUM_CLASSES, tl.sum(low_3, axis=0))
        _prefix_tables(tab, 8, half, True)
        _prefix_tables(tab, 10, half, True)
        # Pass 3: the pair's leftover.
        rho_acc = tl.zeros([BLOCK_V], dtype=tl.float64)
        for start in range(0, vocab, BLOCK_V):
            idx = start + offs
            inside = idx < vocab
            d, q = _row_inputs(p_row, q_row, idx, inside, scale)
            cls = _classes(d, q, 0)
            d_a = _first_take(d, q, cls, tab, inside)[1]
            rho_acc += tl.where(inside, _triple_pair(d_a, q, cls, tab, inside)[2], 0.0)
        rho_pair = tl.sum(rho_acc, axis=0)

        # x3 again: its law given the pair, its demand the pair's leftover given it is reached.
        trio = tl.arange(0, 4)
        tok3 = tl.where(trio == 0, x1, tl.where(trio == 1, x2, x3))
        d_t = scale * tl.load(p_row + tl.maximum(tok3, 0), mask=trio < 3, other=0.0).to(tl.float64)
        q_t = tl.load(q_row + tl.maximum(tok3, 0), mask=trio < 3, other=0.0).to(tl.float64)
        cls_t = _classes(d_t, q_t, 0)
        q1, q2 = _slot_value(q_t, trio, 0), _slot_value(q_t, trio, 1)
        c1, c2, c3 = _slot_value(cls_t, trio, 0), _slot_value(cls_t, trio, 1), _slot_value(cls_t, trio, 2)
        keep = (1.0 - q1) * (1.0 - q2)
        spread = tl.where(1.0 - (q1 + q2) > 0, keep / tl.where(1.0 - (q1 + q2) > 0, 1.0 - (q1 + q2), 1.0), 0.0)
        top = tl.maximum(c1, c2)
        norm = keep - tl.load(tab + 3 * NUM_CLASSES + top, cache_modifier=".cg")
        reached = tl.maximum(1.0 - (sigma_first - rho_pair), 0.0)
        sigma_acc = tl.zeros([BLOCK_V], dtype=tl.float64)
        rho_acc = tl.zeros([BLOCK_V], dtype=tl.float64)
        for start in range(0, vocab, BLOCK_V):
            idx = start + offs
            inside = idx < vocab
            d, q = _row_inputs(p_row, q_row, idx, inside, scale)
            demand, law = _triple_last(d, q, _classes(d, q, 0), tab, inside, idx, x1, x2, top, spread, norm, reached)
            sigma_acc += demand
            rho_acc += demand - tl.minimum(law, demand)
        sigma_last = tl.sum(sigma_acc, axis=0)
        rho_last = tl.sum(rho_acc, axis=0)

        if MODE == LEVEL:
            d_a_t = _first_take(d_t, q_t, cls_t, tab, trio < 3)
            take_t, second_t, _ = _triple_pair(d_a_t[1], q_t, cls_t, tab, trio < 3)
            a_wins = tl.where(c1 == c2, 0.5, tl.where(c1 > c2, 1.0, 0.0))
            b_wins = 1.0 - a_wins
            take_a, take_b = _slot_value(take_t, trio, 0), _slot_value(take_t, trio, 1)
            second_a, second_b = _slot_value(second_t, trio, 0), _slot_value(second_t, trio, 1)
            accept_a = a_wins * take_a + b_wins * (1.0 - take_b) * second_a
            accept_b = b_wins * take_b + a_wins * (1.0 - take_a) * second_b
            demand3, law3 = _triple_last(d_t, q_t, cls_t, tab, trio < 3, tok3, x1, x2, top, spread, norm, reached)
            accept_last = _slot_value(clipped_ratio(demand3, law3), trio, 2)
            tried = tl.where(c3 > top, 1.0, 0.0)
            tried = tried * tl.where(keep > 0, tl.maximum(1.0 - q1 - q2, 0.0) / tl.where(keep > 0, keep, 1.0), 0.0)
            first_taken = tried * _slot_value(d_a_t[0], trio, 2)
            third = first_taken + (1.0 - tried) * (1.0 - (accept_a + accept_b)) * accept_last
            end_a = (1.0 - first_taken) * accept_a
            end_b = (1.0 - first_taken) * accept_b
            child = tl.where(
                slot == 0,
                clipped_ratio(end_a, 1.0),
                tl.where(slot == 1, clipped_ratio(end_b, 1.0 - end_a), clipped_ratio(third, 1.0 - (end_a + end_b))),
            )
            tl.store(weight_ptr + b * stride_wb + kid, child.to(weight_ptr.dtype.element_ty), mask=slot < 3)
            tl.store(stop_ptr + b * stride_wb + node, stop_prob(rho_last, sigma_last).to(stop_ptr.dtype.element_ty))
        else:
            # The next token: x3's leftover at its inverse CDF (as in _wor_pair_kernel).
            uniform = tl.load(uniform_ptr + b)
            total_acc = tl.zeros([BLOCK_V], dtype=tl.float64)
            p_acc = tl.zeros([BLOCK_V], dtype=tl.float64)
            for start in range(0, vocab, BLOCK_V):
                idx = start + offs
                inside = idx < vocab
                p_blk = tl.load(p_row + idx, mask=inside, other=0.0).to(tl.float64)
                d = tl.where(inside, scale * p_blk, 0.0)
                q = tl.load(q_row + idx, mask=inside, other=0.0).to(tl.float64)
                demand, law = _triple_last(
                    d, q, _classes(d, q, 0), tab, inside, idx, x1, x2, top, spread, norm, reached
                )
                total_acc += demand - tl.minimum(law, demand)
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
                inside = idx < vocab
                p_blk = tl.load(p_row + idx, mask=inside, other=0.0).to(tl.float64)
                d = tl.where(inside, scale * p_blk, 0.0)
                q = tl.load(q_row + idx, mask=inside, other=0.0).to(tl.float64)
                demand, law = _triple_last(
                    d, q, _classes(d, q, 0), tab, inside, idx, x1, x2, top, spread, norm, reached
                )
                w = tl.where(use_p, p_blk, demand - tl.minimum(law, demand))
                running, found, choice, last_positive = inverse_cdf_step(
                    w, idx, vocab, target, running, found, choice, last_positive
                )
            tl.store(next_token_ptr + b, tl.where(found == 1, choice, last_positive))


def _launch(mode, p, q, tokens, nodes, tt, weight, stop, uniforms, next_token, grid) -> None:
    batch, _, vocab = p.shape
    children = tt.children
    stages = 1 if children.shape[1] <= 2 else 2
    programs = grid[0] * grid[1]
    scratch = torch.empty(programs, stages * TABLES, _LOG_CLASSES, dtype=torch.float64, device=p.device)
    block_v = min(MAX_WOR_BLOCK_V, block_size(vocab))
    _wor_pair_kernel[grid](
        p_ptr=p,  # [B, N+1, V] target rows p (any float dtype, V contiguous)
        q_ptr=q,  # [B, N+1, V] draft rows q: what each node's children were drawn from
        tokens_ptr=tokens,  # [B, N+1] int64 draft tokens (-1: the node does not exist)
        nodes_ptr=nodes,  # LEVEL: [n] the level's nodes; DRAW: [B] the end node of each request
        children_ptr=children,  # [N+1, C] int64: each node's children in slot order, -1 padded
        kid_sizes_ptr=tt.kid_sizes,  # [N+1, C] int64: nodes in each child slot's subtree, 0 where none
        weight_ptr=weight,  # [B, N+1] work dtype: read (P~ of the node), written (LEVEL: the children's)
        stop_ptr=stop,  # [B, N+1] work dtype (LEVEL: h of the node)
        uniform_ptr=uniforms,  # [B] float64 (DRAW)
        next_token_ptr=next_token,  # [B] int64 (DRAW)
        scratch_ptr=scratch,  # [programs, TABLES, NUM_CLASSES] float64
        stride_pb=p.stride(0),
        stride_pn=p.stride(1),
        stride_qb=q.stride(0),
        stride_qn=q.stride(1),
        stride_tb=tokens.stride(0),
        stride_cn=children.stride(0),
        stride_wb=weight.stride(0),
        vocab=vocab,  # V
        num_slots=children.shape[1],  # C: child slots per node
        MODE=mode,
        STAGES=stages,  # 1: at most two children per node; 2: three or four (two pair stages)
        WEIGHTED=not tt.even_pairs,  # slots weighed by sqrt(subtree size) (not TreeSpec.even_pairs)
        THREE_CHILD_STAGE=tt.three_child_stage,  # nodes taking it are left to _wor_triple_kernel
        BLOCK_V=block_v,
    )
    if tt.three_child_stage:  # the nodes the pair kernel left to the three-child stage
        scratch = torch.empty(programs, TRIPLE_TABLES.value, _LOG_CLASSES, dtype=torch.float64, device=p.device)
        _wor_triple_kernel[grid](
            p_ptr=p,  # [B, N+1, V] target rows p (any float dtype, V contiguous)
            q_ptr=q,  # [B, N+1, V] draft rows q: what each node's children were drawn from
            tokens_ptr=tokens,  # [B, N+1] int64 draft tokens (-1: the node does not exist)
            nodes_ptr=nodes,  # LEVEL: [n] the level's nodes; DRAW: [B] the end node of each request
            children_ptr=children,  # [N+1, C] int64: each node's children in slot order, -1 padded
            kid_sizes_ptr=tt.kid_sizes,  # [N+1, C] int64: nodes in each child slot's subtree, 0 where none
            weight_ptr=weight,  # [B, N+1] work dtype: read (P~ of the node), written (LEVEL: the children's)
            stop_ptr=stop,  # [B, N+1] work dtype (LEVEL: h of the node)
            uniform_ptr=uniforms,  # [B] float64 (DRAW)
            next_token_ptr=next_token,  # [B] int64 (DRAW)
            scratch_ptr=scratch,  # [programs, TRIPLE_TABLES, NUM_CLASSES] float64
            stride_pb=p.stride(0),
            stride_pn=p.stride(1),
            stride_qb=q.stride(0),
            stride_qn=q.stride(1),
            stride_tb=tokens.stride(0),
            stride_cn=children.stride(0),
            stride_wb=weight.stride(0),
            vocab=vocab,  # V
            MODE=mode,
            BLOCK_V=block_v,
        )


def wor_level(p, q, tokens, nodes, tt, weight, stop) -> None:
    """univer_wor's rule at ``nodes`` [n] (one depth level) of every request, in place:
    the children's weights (entry scales) into ``weight`` [B, N+1], h into ``stop``."""
    batch, num_nodes, _ = expect_tree_rows(p, q, tokens)
    expect("nodes", nodes, (None,), torch.int64)
    expect("weight", weight, (batch, num_nodes))
    expect("stop", stop, (batch, num_nodes))
    _launch(LEVEL.value, p, q, tokens, nodes, tt, weight, stop, None, None, (p.shape[0], nodes.numel()))


def wor_draw(p, q, tokens, end, tt, weight, uniforms) -> torch.Tensor:
    """The next token of each request [B] int64: the end node's residual R (``end`` [B]; its
    entry scale in ``weight`` [B, N+1]) drawn by inverse CDF at ``uniforms`` [B] float64."""
    batch, num_nodes, _ = expect_tree_rows(p, q, tokens)
    expect("end", end, (batch,), torch.int64)
    expect("weight", weight, (batch, num_nodes))
    expect("uniforms", uniforms, (batch,), torch.float64)
    next_token = torch.empty(p.shape[0], dtype=torch.int64, device=p.device)
    _launch(DRAW.value, p, q, tokens, end, tt, weight, None, uniforms, next_token, (p.shape[0], 1))
    return next_token
