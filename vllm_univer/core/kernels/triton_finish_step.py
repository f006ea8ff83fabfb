"""Triton kernel: the rest of a tree verification step after the per-level node
rules (``triton_topk1_verify``, ``triton_replay_verify``), one launch, one
program per request:

* the end node from the weights and the uniforms: the first node in post-order
  with eta < h (POSTORDER rules, ``tree_pass.decide_postorder`` with
  ``finish_stop``'s conventions) or the walk down taking the first child slot
  with eta < alpha (DESCENT rules, ``decide_descent``), over the tree's index
  tables;
* for a greedy row argmax matching instead (``api._argmax_matching``: one pass
  over p per node on its path, first index on ties);
* the next token drawn from the end node's residual row
  (``triton_rows.draw_residual``: its mass, then an inverse-CDF search in
  float64 block sums, never writing a [B, V] row);
* the output row (accepted tokens, the next token, -1 padded).

The residual row per rule (``RESIDUALS``): univer / greedy
[P~ p - q / q(off T)]+ off the top set T (``params`` = 1 / q(off T), 0 at a
node without a sampled child); target_only p off the children's tokens; rrs /
rrsw / traversal the node's rejections R_C replayed from p and q (``params`` =
the steps' a_j, then c_j).

Tensors: p, q [B, N+1, V] (last dim contiguous; any float dtype); tokens
[B, N+1] int64 (-1: missing); uniforms [B, N+2] float64 (eta per node, then Y's).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import children_strides, expect, expect_tree_rows
from .triton_rows import (
    RESIDUAL_CLIPPED,
    RESIDUAL_P,
    RESIDUAL_REPLAY,
    block_size,
    child_slots,
    draw_residual,
    first_argmax,
    slot_block,
)

# method: (decided in post-order, residual row, rejected tokens leave Q)
RESIDUALS = {
    "univer": (True, RESIDUAL_CLIPPED.value, False),
    "greedy": (False, RESIDUAL_CLIPPED.value, False),
    "target_only": (False, RESIDUAL_P.value, False),
    "rrs": (False, RESIDUAL_REPLAY.value, False),
    "rrsw": (False, RESIDUAL_REPLAY.value, True),
    "traversal": (True, RESIDUAL_REPLAY.value, True),
}


@triton.jit
def _finish_kernel(
    p_ptr,  # [B, N+1, V] target rows p (any float dtype, V contiguous)
    q_ptr,  # [B, N+1, V] draft rows q: what each node's children were drawn from
    tokens_ptr,  # [B, N+1] int64 draft tokens (-1: the node does not exist)
    children_ptr,  # [(B,) N+1, C] int64: each node's children in slot order, -1 padded
    postorder_ptr,  # [(B,) N+1] int64: the nodes in post-order (the root last)
    is_internal_ptr,  # [(B,) N+1] int8: the shape gives the node children
    ancestors_ptr,  # [(B,) N+1, D] int64: the path to each node, root excluded, -1 padded
    depth_ptr,  # [N+1] int64
    weight_ptr,  # [B, N+1]: alpha (DESCENT) or entry P~ (POSTORDER)
    stop_ptr,  # [B, N+1]: the rule's h of internal nodes (POSTORDER)
    params_ptr,  # [B, N+1, *] float64: the residual's 1 / q(off T), or a_j then c_j
    uniform_ptr,  # [B, N+2] float64: eta per node, then Y's
    greedy_ptr,  # [B] int8 (read if HAS_GREEDY)
    end_ptr,  # [B] int64: written, or read where the end is given (DECIDE false)
    accepted_ptr,  # [B] int64, written: depth of the end node
    out_ptr,  # [B, D+1] int64, written: accepted tokens, the next token, -1 padded
    stride_pb,
    stride_pn,
    stride_qb,
    stride_qn,
    stride_tb,
    stride_cb,  # the tables' request strides: 0 for one tree shared by the batch
    stride_cn,
    stride_ob_post,
    stride_ib,
    stride_ab,
    stride_an,
    stride_wb,
    stride_sb,
    stride_rb,
    stride_rn,
    stride_ub,
    stride_ob,
    vocab,  # V
    num_nodes,  # N + 1
    num_slots,  # C: child slots per node
    max_depth,  # D
    POSTORDER: tl.constexpr,
    RESIDUAL: tl.constexpr,
    REMOVES: tl.constexpr,
    DECIDE: tl.constexpr,
    HAS_GREEDY: tl.constexpr,
    SLOTS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0)
    greedy = tl.zeros((), dtype=tl.int1)
    if HAS_GREEDY:
        greedy = tl.load(greedy_ptr + b) != 0
    end = tl.zeros((), dtype=tl.int64)
    if not DECIDE:
        end = tl.load(end_ptr + b)
    elif POSTORDER:
        # The first node in post-order with eta < h; the root (last) always qualifies.
        found = tl.zeros((), dtype=tl.int1)
        for k in range(0, num_nodes):
            v = tl.load(postorder_ptr + b * stride_ob_post + k)
            exists = (v == 0) | (tl.load(tokens_ptr + b * stride_tb + v) >= 0)
            internal = tl.load(is_internal_ptr + b * stride_ib + v) != 0
            h = tl.where(internal, tl.load(stop_ptr + b * stride_sb + v), tl.load(weight_ptr + b * stride_wb + v))
            h = tl.where(v == 0, 1.0, tl.where(exists, h.to(tl.float64), 0.0))
            hit = (found == 0) & ((tl.load(uniform_ptr + b * stride_ub + v) < h) | (v == 0))
            end = tl.where(hit, v, end)
            found = found | hit
    else:
        # At each node the first child slot with eta < alpha.
        walking = tl.full((), 1, tl.int1)
        for _ in range(0, max_depth):
            slot, kid, _tok = child_slots(
                children_ptr + b * stride_cb, tokens_ptr, b, end, stride_tb, stride_cn, num_slots, SLOTS
            )
            safe = tl.maximum(kid, 0)
            alpha = tl.load(weight_ptr + b * stride_wb + safe, mask=kid >= 0, other=0.0).to(tl.float64)
            eta = tl.load(uniform_ptr + b * stride_ub + safe, mask=kid >= 0, other=1.0)
            first = tl.min(tl.where((kid >= 0) & (eta < alpha), slot, SLOTS), axis=0)
            moved = walking & (first < SLOTS)
            end = tl.where(moved, tl.sum(tl.where(slot == first, kid, 0), axis=0).to(tl.int64), end)
            walking = moved

    choice = tl.zeros((), dtype=tl.int64)
    if greedy:
        # Into the first child that is its parent's argmax; Y = the end's argmax.
        end = tl.zeros((), dtype=tl.int64)
        walking = tl.full((), 1, tl.int1)
        for _ in range(0, max_depth + 1):
            if walking:
                argmax = first_argmax(p_ptr + b * stride_pb + end * stride_pn, vocab, BLOCK_V)
                slot, kid, tok = child_slots(
                    children_ptr + b * stride_cb, tokens_ptr, b, end, stride_tb, stride_cn, num_slots, SLOTS
                )
                first = tl.min(tl.where((kid >= 0) & (tok == argmax), slot, SLOTS), axis=0)
                walking = first < SLOTS
                choice = tl.where(walking, choice, argmax)
                end = tl.where(walking, tl.sum(tl.where(slot == first, kid, 0), axis=0).to(tl.int64), end)
    else:
        slot, kid, tok = child_slots(
            children_ptr + b * stride_cb, tokens_ptr, b, end, stride_tb, stride_cn, num_slots, SLOTS
        )
        params = params_ptr + b * stride_rb + end * stride_rn
        scale = tl.full((), 1.0, tl.float64)
        q_scale = tl.full((), 0.0, tl.float64)
        a_vec = tl.full([SLOTS], 1.0, tl.float64)
        c_vec = tl.zeros([SLOTS], dtype=tl.float64)
        if RESIDUAL == RESIDUAL_CLIPPED:
            tok = tl.where(slot >= 1, tok, -1)  # only the top set T is removed; the sampled token stays
            q_scale = tl.load(params)
            if POSTORDER:
                scale = tl.load(weight_ptr + b * stride_wb + end).to(tl.float64)
        if RESIDUAL == RESIDUAL_REPLAY:  # a leaf has no rejections: R = p
            a_vec = tl.load(params + slot, mask=kid >= 0, other=1.0)
            c_vec = tl.load(params + num_slots + slot, mask=kid >= 0, other=0.0)
        uniform = tl.load(uniform_ptr + b * stride_ub + num_nodes)
        p_row = p_ptr + b * stride_pb + end * stride_pn
        q_row = q_ptr + b * stride_qb + end * stride_qn
        # Not ``_``: compiled Triton types a name once across both branches of the ``if``,
        # and the greedy branch's loop counter is an int32 ``_``.
        choice, _residual_mass = draw_residual(
            p_row, q_row, tok, slot, scale, q_scale, a_vec, c_vec, uniform, vocab, RESIDUAL, REMOVES, True, BLOCK_V
        )

    # The output row (api._assemble): the path's tokens, then Y, then -1.
    accepted = tl.load(depth_ptr + end)
    for j in range(0, max_depth + 1):
        node = tl.load(ancestors_ptr + b * stride_ab + end * stride_an + j, mask=j < max_depth, other=-1)
        drafted = tl.load(tokens_ptr + b * stride_tb + tl.maximum(node, 0), mask=node >= 0, other=-1)
        tl.store(out_ptr + b * stride_ob + j, tl.where(j < accepted, drafted, tl.where(j == accepted, choice, -1)))
    tl.store(end_ptr + b, end)
    tl.store(accepted_ptr + b, accepted)


def finish_step(
    rule: str,
    p: torch.Tensor,
    q: torch.Tensor,
    tokens: torch.Tensor,
    tree,
    weight: torch.Tensor,
    stop: torch.Tensor,
    params: torch.Tensor,
    uniforms: torch.Tensor,
    greedy: torch.Tensor | None = None,
    end: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rest of the step after the level kernels, one program per request: the
    end node (from ``uniforms`` [B, N+2] float64: eta per node, then Y's; or the
    given ``end`` [B]), greedy rows' argmax matching (``greedy`` [B] bool), the
    next token drawn from the end node's residual and the output row.

    ``tree``: the ``_TreeTensors`` of the shape, or a ``TreeBatch`` (each request's
    own children, post-order, internal flags and ancestors; depth per position
    shared); weight, stop [B, N+1] and
    ``params`` ([B, N+1] 1 / q(off T) for univer / greedy / target_only, or
    [B, N+1, 2C] rejection steps for rrs / rrsw / traversal) as the level kernels
    wrote them. Returns output rows [B, D+1], accepted tokens [B] and the end
    node [B] (int64)."""
    batch, num_nodes, vocab = expect_tree_rows(p, q, tokens)
    expect("weight", weight, (batch, num_nodes))
    expect("stop", stop, (batch, num_nodes))
    expect("params", params, (batch, num_nodes, *params.shape[2:]), torch.float64)
    expect("uniforms", uniforms, (batch, num_nodes + 1), torch.float64)
    expect("greedy", greedy, (batch,), (torch.bool, torch.int8))
    expect("end", end, (batch,), torch.int64)
    postorder, residual, removes = RESIDUALS[rule]
    decide = end is None
    end = torch.empty(batch, dtype=torch.long, device=p.device) if decide else end.clone()
    accepted = torch.empty_like(end)
    out = torch.empty(batch, tree.max_depth + 1, dtype=torch.long, device=p.device)
    greedy_flags = greedy.to(torch.int8) if greedy is not None else None
    num_slots = tree.children.shape[-1]
    stride_cb, stride_cn = children_strides(tree.children, batch, num_nodes)
    postorder_table, is_internal, ancestors = tree.postorder, tree.is_internal_int8, tree.ancestors
    per_request = tree.children.dim() == 3  # each request's own tables (TreeBatch), else one tree's
    lead = (batch,) if per_request else ()
    expect("postorder", postorder_table, (*lead, num_nodes), torch.int64, last_contiguous=True)
    expect("is_internal", is_internal, (*lead, num_nodes), torch.int8, last_contiguous=True)
    expect("ancestors", ancestors, (*lead, num_nodes, None), torch.int64, last_contiguous=True)
    expect("depth", tree.depth, (num_nodes,), torch.int64)
    _finish_kernel[(batch,)](
        p_ptr=p,  # [B, N+1, V] target rows p (any float dtype, V contiguous)
        q_ptr=q,  # [B, N+1, V] draft rows q: what each node's children were drawn from
        tokens_ptr=tokens,  # [B, N+1] int64 draft tokens (-1: the node does not exist)
        children_ptr=tree.children,  # [(B,) N+1, C] int64: each node's children in slot order, -1 padded
        postorder_ptr=postorder_table,  # [(B,) N+1] int64: the nodes in post-order (the root last)
        is_internal_ptr=is_internal,  # [(B,) N+1] int8: the shape gives the node children
        ancestors_ptr=ancestors,  # [(B,) N+1, D] int64: the path to each node, root excluded, -1 padded
        depth_ptr=tree.depth,  # [N+1] int64
        weight_ptr=weight,  # [B, N+1]: alpha (DESCENT) or entry P~ (POSTORDER)
        stop_ptr=stop,  # [B, N+1]: the rule's h of internal nodes (POSTORDER)
        params_ptr=params,  # [B, N+1, *] float64: the residual's 1 / q(off T), or a_j then c_j
        uniform_ptr=uniforms,  # [B, N+2] float64: eta per node, then Y's
        greedy_ptr=greedy_flags,  # [B] int8 (read if HAS_GREEDY)
        end_ptr=end,  # [B] int64: written, or read where the end is given (DECIDE false)
        accepted_ptr=accepted,  # [B] int64, written: depth of the end node
        out_ptr=out,  # [B, D+1] int64, written: accepted tokens, the next token, -1 padded
        stride_pb=p.stride(0),
        stride_pn=p.stride(1),
        stride_qb=q.stride(0),
        stride_qn=q.stride(1),
        stride_tb=tokens.stride(0),
        stride_cb=stride_cb,
        stride_cn=stride_cn,
        stride_ob_post=postorder_table.stride(0) if per_request else 0,
        stride_ib=is_internal.stride(0) if per_request else 0,
        stride_ab=ancestors.stride(0) if per_request else 0,
        stride_an=ancestors.stride(-2),
        stride_wb=weight.stride(0),
        stride_sb=stop.stride(0),
        stride_rb=params.stride(0),
        stride_rn=params.stride(1),
        stride_ub=uniforms.stride(0),
        stride_ob=out.stride(0),
        vocab=vocab,  # V
        num_nodes=num_nodes,  # N + 1
        num_slots=num_slots,  # C: child slots per node
        max_depth=tree.max_depth,  # D
        POSTORDER=postorder,
        RESIDUAL=residual,
        REMOVES=removes,
        DECIDE=decide,
        HAS_GREEDY=greedy is not None,
        SLOTS=slot_block(num_slots),
        BLOCK_V=block_size(vocab),
    )
    return out, accepted, end
