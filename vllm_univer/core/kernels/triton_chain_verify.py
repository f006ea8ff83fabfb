"""Triton kernel: a whole chain verification step (``token`` and ``block``) in
one launch, one program per request (the CUDA path of ``verify`` for chains).

The PyTorch path runs the node rules level by level, then the decision, then
the residual draw: ~400 small ATen ops for a 1x5 chain, each a kernel launch
on CUDA. A chain needs none of that batching: one program walks its request's
chain top-down, node i after node i-1, and

    token  alpha_{i+1} = min(1, p_i(x_{i+1}) / q_i(x_{i+1}));
           the walk takes node i+1 while eta_{i+1} < alpha_{i+1};
           Y ~ [p_e - q_e]+ (p_e at a leaf)
    block  P~_{i+1} = min(1, P~_i p_i(x_{i+1}) / q_i(x_{i+1})),
           h_i = S_i / (S_i + 1 - P~_i), S_i = sum_y [P~_i p_i(y) - q_i(y)]+
           (q_i left out where the child is missing, h = P~ at the chain's last
           node, 1 at the root: one pass over p_i, q_i per node);
           the end is the deepest node with eta_i < h_i (post-order on a chain);
           Y ~ [P~_e p_e - q_e]+ (p_e at a leaf)

with the same formulas as ``verifiers/token_level.py`` and ``block.py`` in
float64, then draws Y from the end node's residual (``triton_rows.draw_residual``).
A greedy row instead walks by argmax matching (``api._argmax_matching``: the
child is taken while it is its parent's argmax p, first index on ties; Y is the
end node's argmax). The program writes the step's output row itself (accepted
tokens, then Y, -1 padded), and the per-node weights (alpha, or P~ on entry)
and stop probabilities, so that tests can hold them against the PyTorch rules.

Tensors: p, q [B, N+1, V] (last dim contiguous; any float dtype); tokens
[B, N+1] int64 (node i+1 is node i's child; -1: missing, and so is the rest);
uniforms [B, N+2] float64 (eta per node, then Y's); greedy [B] bool.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import expect, expect_tree_rows
from .triton_rows import RESIDUAL_CLIPPED, block_size, clipped_ratio, draw_residual, first_argmax, stop_prob

# Kernel-visible constants must be tl.constexpr (compiled Triton rejects plain globals; the
# interpreter does not); host code passes their ``.value``.
TOKEN, BLOCK = tl.constexpr(0), tl.constexpr(1)
RULES = {"token": TOKEN.value, "block": BLOCK.value}


@triton.jit
def _chain_verify_kernel(
    p_ptr,  # [B, N+1, V] target rows p on the chain (any float dtype, V contiguous)
    q_ptr,  # [B, N+1, V] draft rows q (row i: what node i+1 was drawn from)
    tokens_ptr,  # [B, N+1] int64 the chain's tokens (-1: the node does not exist)
    uniform_ptr,  # [B, N+2] float64: eta per node, then Y's
    greedy_ptr,  # [B] int8 (read if HAS_GREEDY)
    weight_ptr,  # [B, N+1] float64, written: alpha (token) or P~ on entry (block); 1 at the root
    stop_ptr,  # [B, N+1] float64, written (block): h, with ``tree_pass.finish_stop``'s conventions
    end_ptr,  # [B] int64, written: the end node (= accepted tokens)
    out_ptr,  # [B, N+1] int64, written: accepted tokens, then the next token, then -1
    stride_pb,
    stride_pn,
    stride_qb,
    stride_qn,
    stride_tb,
    stride_ub,
    stride_wb,
    stride_ob,
    vocab,  # V
    num_nodes,  # N + 1
    RULE: tl.constexpr,
    HAS_GREEDY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0)
    offs = tl.arange(0, BLOCK_V)
    greedy = tl.zeros((), dtype=tl.int1)
    if HAS_GREEDY:
        greedy = tl.load(greedy_ptr + b) != 0
    greedy_walking = greedy  # a greedy row's walk has reached node i
    greedy_end = tl.zeros((), dtype=tl.int64)
    greedy_next = tl.zeros((), dtype=tl.int64)
    tl.store(weight_ptr + b * stride_wb, 1.0)
    scale = tl.full((), 1.0, tl.float64)  # block: P~ of node i
    alive = tl.full((), 1, tl.int1)  # node i exists
    walking = tl.full((), 1, tl.int1)  # token: the walk has reached node i
    end = tl.zeros((), dtype=tl.int64)
    end_scale = tl.full((), 1.0, tl.float64)
    end_has_child = tl.zeros((), dtype=tl.int1)
    for i in range(0, num_nodes):
        x = tl.load(tokens_ptr + b * stride_tb + i + 1, mask=i + 1 < num_nodes, other=-1)
        has_child = alive & (x >= 0)
        p_row = p_ptr + b * stride_pb + i * stride_pn
        q_row = q_ptr + b * stride_qb + i * stride_qn
        p_x = tl.load(p_row + tl.maximum(x, 0), mask=has_child, other=0.0).to(tl.float64)
        q_x = tl.load(q_row + tl.maximum(x, 0), mask=has_child, other=0.0).to(tl.float64)
        if RULE == TOKEN:
            child = tl.where(has_child, clipped_ratio(p_x, q_x), 0.0)
            eta = tl.load(uniform_ptr + b * stride_ub + i + 1, mask=i + 1 < num_nodes, other=1.0)
            take = walking & has_child & (eta < child)
            ends_here = walking & (take == 0)
            end = tl.where(ends_here, i, end)
            end_has_child = tl.where(ends_here, has_child, end_has_child)
            walking = take
        else:
            acc = tl.zeros([BLOCK_V], dtype=tl.float64)
            for start in range(0, vocab, BLOCK_V):
                inside = start + offs < vocab
                p_blk = tl.load(p_row + start + offs, mask=inside, other=0.0).to(tl.float64)
                q_blk = tl.load(q_row + start + offs, mask=inside, other=0.0).to(tl.float64)
                acc += tl.maximum(scale * p_blk - tl.where(has_child, q_blk, 0.0), 0.0)
            # The rule's h wherever the shape has a child slot (the drafted child may be
            # missing), P~ at the chain's last node (``finish_stop``).
            h = tl.where(i + 1 < num_nodes, stop_prob(tl.sum(acc, axis=0), scale), scale)
            h = tl.where(i == 0, 1.0, tl.where(alive, h, 0.0))
            tl.store(stop_ptr + b * stride_wb + i, h)
            child = tl.where(has_child, clipped_ratio(scale * p_x, q_x), 0.0)
            eta = tl.load(uniform_ptr + b * stride_ub + i)
            hit = alive & ((eta < h) | (i == 0))  # the deepest hit is the first in post-order
            end = tl.where(hit, i, end)
            end_scale = tl.where(hit, scale, end_scale)
            end_has_child = tl.where(hit, has_child, end_has_child)
            scale = child
        tl.store(weight_ptr + b * stride_wb + i + 1, child, mask=i + 1 < num_nodes)
        if HAS_GREEDY:  # compiled out without greedy rows: Triton 3.6's TritonGPUCoalesce crashes on it
            if greedy_walking:
                argmax = first_argmax(p_row, vocab, BLOCK_V)
                match = has_child & (x == argmax)
                greedy_end = tl.where(match, greedy_end, i)
                greedy_next = tl.where(match, greedy_next, argmax)
                greedy_walking = match
        alive = has_child

    choice = greedy_next
    if greedy:
        end = greedy_end
    else:
        p_row = p_ptr + b * stride_pb + end * stride_pn
        q_row = q_ptr + b * stride_qb + end * stride_qn
        uniform = tl.load(uniform_ptr + b * stride_ub + num_nodes)
        none_removed = tl.full([2], -1, tl.int64)
        slot = tl.arange(0, 2)
        q_scale = tl.where(end_has_child, 1.0, 0.0).to(tl.float64)
        choice, _ = draw_residual(
            p_row,
            q_row,
            none_removed,
            slot,
            end_scale,
            q_scale,
            end_scale,
            q_scale,
            uniform,
            vocab,
            RESIDUAL_CLIPPED,
            False,
            True,
            BLOCK_V,
        )
    tl.store(end_ptr + b, end)
    for j in range(0, num_nodes):
        drafted = tl.load(tokens_ptr + b * stride_tb + j + 1, mask=j + 1 < num_nodes, other=-1)
        tl.store(out_ptr + b * stride_ob + j, tl.where(j < end, drafted, tl.where(j == end, choice, -1)))


def chain_verify(
    rule: str,
    p: torch.Tensor,
    q: torch.Tensor,
    tokens: torch.Tensor,
    uniforms: torch.Tensor,
    greedy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chain verification step of every request.

    p, q [B, N+1, V]; tokens [B, N+1] int64; uniforms [B, N+2] float64 in [0, 1);
    greedy [B] bool or None. Returns the output rows [B, N+1] int64 (accepted
    tokens, the next token, -1 padded: ``VerifyOutput.output_token_ids``), the
    end node [B] int64 (= accepted tokens), weight [B, N+1] float64 (alpha or
    entry P~) and stop [B, N+1] float64 (block's h; zeros for token)."""
    batch, num_nodes, vocab = expect_tree_rows(p, q, tokens)
    expect("uniforms", uniforms, (batch, num_nodes + 1), torch.float64)
    expect("greedy", greedy, (batch,), (torch.bool, torch.int8))
    # The kernel writes every weight, and every stop probability for block: no fill.
    weight = torch.empty(batch, num_nodes, dtype=torch.float64, device=p.device)
    stop = torch.empty_like(weight) if rule == "block" else torch.zeros_like(weight)
    end = torch.empty(batch, dtype=torch.long, device=p.device)
    out = torch.empty(batch, num_nodes, dtype=torch.long, device=p.device)
    greedy_flags = greedy.to(torch.int8) if greedy is not None else None
    _chain_verify_kernel[(batch,)](
        p_ptr=p,  # [B, N+1, V] target rows p on the chain (any float dtype, V contiguous)
        q_ptr=q,  # [B, N+1, V] draft rows q (row i: what node i+1 was drawn from)
        tokens_ptr=tokens,  # [B, N+1] int64 the chain's tokens (-1: the node does not exist)
        uniform_ptr=uniforms,  # [B, N+2] float64: eta per node, then Y's
        greedy_ptr=greedy_flags,  # [B] int8 (read if HAS_GREEDY)
        weight_ptr=weight,  # [B, N+1] float64, written: alpha (token) or P~ on entry (block); 1 at the root
        stop_ptr=stop,  # [B, N+1] float64, written (block): h, with ``tree_pass.finish_stop``'s conventions
        end_ptr=end,  # [B] int64, written: the end node (= accepted tokens)
        out_ptr=out,  # [B, N+1] int64, written: accepted tokens, then the next token, then -1
        stride_pb=p.stride(0),
        stride_pn=p.stride(1),
        stride_qb=q.stride(0),
        stride_qn=q.stride(1),
        stride_tb=tokens.stride(0),
        stride_ub=uniforms.stride(0),
        stride_wb=weight.stride(0),
        stride_ob=out.stride(0),
        vocab=vocab,  # V
        num_nodes=num_nodes,  # N + 1
        RULE=RULES[rule],
        HAS_GREEDY=greedy is not None,
        BLOCK_V=block_size(vocab),
    )
    return out, end, weight, stop
