"""Triton kernel: draw the children of one level's nodes by a draft scheme (the
CUDA path of the engine's drafter), one launch per level and child count.

``drafting.draft_children`` costs 40-110 small ATen ops per call (block sums,
two-stage searches, top-k with a tie check that reads the device for k >= 2),
each a kernel launch on CUDA, at every depth of every step. Here one program per
(request, node) reads its row and writes its m children in slot order:

    chain, iid  m tokens by inverse CDF of q at m uniforms
    wor         token j by inverse CDF of q with tokens 0..j-1 removed (-1 once
                nothing is left): sequential sampling without replacement
    topk1       slots 1..m-1 the top tokens of q (rank order, ties to the lower
                id: ``drafting.top_tokens``), slot 0 by inverse CDF of q off them
                (-1 where they hold all of q)
    greedy row  the m top tokens (``top_tokens(rows, m)``; rows may be logits)

Each draw is two float64 passes over the row (its mass, then the search:
``triton_rows.draw_excluding``), each top token one pass (``top_token``). The
uniforms come in as one [R, K, m] float64 tensor: the law is the scheme's for
every request; only the stream of random numbers differs from the PyTorch path.

With ``into`` the same program also writes the children into the step's
token table (-1 under a node whose own token is -1), which the drafter would
otherwise do with five more launches per call.

Tensors: rows [R, W, V] (last dim contiguous; q, or logits for greedy rows);
row_index [K] int64 (the nodes' rows among the W); uniforms [R, K, m] float64;
greedy [R] bool or int8; out [R, K, m] int64; into: tokens [R, N+1] int64, the K
nodes' ids [K] int64 and their children's ids [K, m] int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import FLOATS, expect
from .triton_rows import block_size, draw_excluding, slot_block, top_token

# Kernel-visible constants must be tl.constexpr (compiled Triton rejects plain globals; the
# interpreter does not); host code passes their ``.value``.
CHAIN, IID, WOR, TOPK1 = (tl.constexpr(v) for v in range(4))
SCHEMES = {"chain": CHAIN.value, "iid": IID.value, "wor": WOR.value, "topk1": TOPK1.value}


@triton.jit
def _draft_children_kernel(
    rows_ptr,  # [R, W, V] q rows (or logits where every request is greedy), V contiguous
    row_index_ptr,  # [K] int64: which of the W rows of a request each node reads
    uniform_ptr,  # [R, K, M] float64: one uniform per child draw (not read if ALL_GREEDY)
    greedy_ptr,  # [R] int8 (read if HAS_GREEDY)
    out_ptr,  # [R, K, M] int64, written: the children's tokens, -1 where none exists
    tokens_ptr,  # [R, N+1] int64 token table (written if WRITE_TOKENS)
    node_ptr,  # [K] int64: the nodes' ids in the table
    kid_ptr,  # [K, M] int64: their children's ids
    node_children_ptr,  # [R, K] int64: each node's own k_v <= M (read if PER_NODE)
    stride_rr,
    stride_rw,
    stride_ur,
    stride_uk,
    stride_or,
    stride_ok,
    stride_tr,
    stride_kk,
    stride_nr,
    vocab,  # V
    SCHEME: tl.constexpr,
    M: tl.constexpr,  # children per node
    SLOTS: tl.constexpr,  # M rounded up to a power of 2
    HAS_GREEDY: tl.constexpr,
    ALL_GREEDY: tl.constexpr,
    WRITE_TOKENS: tl.constexpr,
    PER_NODE: tl.constexpr,  # topk1 / greedy rows at each node's own k_v
    BLOCK_V: tl.constexpr,
):
    r = tl.program_id(0)
    k = tl.program_id(1)
    row = rows_ptr + r * stride_rr + tl.load(row_index_ptr + k) * stride_rw
    uniforms = uniform_ptr + r * stride_ur + k * stride_uk
    slot = tl.arange(0, SLOTS)
    kids = tl.full([SLOTS], -1, tl.int64)
    greedy = tl.full((), ALL_GREEDY, tl.int1)
    if HAS_GREEDY:
        greedy = tl.load(greedy_ptr + r) != 0
    if greedy:
        for j in tl.static_range(M):
            kids = tl.where(slot == j, top_token(row, kids, vocab, BLOCK_V), kids)
    elif SCHEME == TOPK1:
        for j in tl.static_range(1, M):
            kids = tl.where(slot == j, top_token(row, kids, vocab, BLOCK_V), kids)
        if PER_NODE:  # slot 0 is drawn off v's own k_v - 1 top tokens only
            kids = tl.where(slot < tl.load(node_children_ptr + r * stride_nr + k), kids, -1)
        sampled = draw_excluding(row, kids, slot, tl.load(uniforms), vocab, BLOCK_V)
        kids = tl.where(slot == 0, sampled, kids)
    else:
        none = tl.full([SLOTS], -1, tl.int64)
        for j in tl.static_range(M):
            if SCHEME == WOR:  # off the tokens drawn so far
                drawn = draw_excluding(row, kids, slot, tl.load(uniforms + j), vocab, BLOCK_V)
            else:
                drawn = draw_excluding(row, none, slot, tl.load(uniforms + j), vocab, BLOCK_V)
            kids = tl.where(slot == j, drawn, kids)
    if PER_NODE:  # slots at or past k_v do not exist
        kids = tl.where(slot < tl.load(node_children_ptr + r * stride_nr + k), kids, -1)
    tl.store(out_ptr + r * stride_or + k * stride_ok + slot, kids, mask=slot < M)
    if WRITE_TOKENS:
        # A node without a token (its parent had no child to draw) has no children either.
        node_token = tl.load(tokens_ptr + r * stride_tr + tl.load(node_ptr + k))
        kids = tl.where(node_token < 0, -1, kids)
        kid_ids = tl.load(kid_ptr + k * stride_kk + slot, mask=slot < M, other=0)
        tl.store(tokens_ptr + r * stride_tr + kid_ids, kids, mask=slot < M)


def draft_children_fused(
    scheme: str,
    rows: torch.Tensor,
    row_index: torch.Tensor,
    num_children: int,
    greedy: torch.Tensor | None = None,
    all_greedy: bool = False,
    generator: torch.Generator | None = None,
    into: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    node_children: torch.Tensor | None = None,
) -> torch.Tensor:
    """The children of K nodes of R requests, ``drafting.draft_children``'s law.

    rows [R, W, V] (last dim contiguous; a q buffer's level, or logits where
    every row is greedy), row_index [K] int64 (which of the W rows are the K
    nodes), greedy [R] bool or int8 (those rows take the top ``num_children`` tokens,
    ``top_tokens``), all_greedy: every row greedy (greedy then not read).
    into: (tokens [R, N+1] int64, nodes [K] int64, kids [K, m] int64): also
    ``tokens[:, kids] = children``, -1 under a node whose token is -1.
    node_children [R, K] int64, k_v in 0..m (``topk1`` only, the law of
    ``dynamic_tree.draw_children``): node v's slot 0 is drawn off its own k_v - 1
    top tokens, greedy rows take k_v top tokens, slots at or past k_v are -1.
    Returns LongTensor [R, K, m], -1 where a child does not exist."""
    if rows.dim() != 3:
        raise ValueError(f"rows: expected shape [R, W, V], got {list(rows.shape)}")
    batch, _, vocab = rows.shape
    expect("rows", rows, tuple(rows.shape), FLOATS, last_contiguous=True)
    expect("row_index", row_index, (None,), torch.int64, device=rows.device)
    expect("greedy", greedy, (batch,), (torch.bool, torch.int8))
    m = int(num_children)
    nodes = row_index.numel()
    if node_children is not None:
        if scheme != "topk1":
            raise ValueError(f"draft_children_fused: per-node child counts are for topk1, not {scheme!r}")
        expect("node_children", node_children, (batch, nodes), torch.int64, last_contiguous=True, device=rows.device)
    out = torch.empty(batch, nodes, m, dtype=torch.long, device=rows.device)
    if all_greedy:  # no draws: the uniforms are not read (an allocation, no launch)
        uniforms = torch.empty(1, 1, 1, dtype=torch.float64, device=rows.device)
    else:
        uniforms = torch.rand(batch, nodes, m, generator=generator, device=rows.device, dtype=torch.float64)
    greedy_flags = greedy.to(torch.int8) if greedy is not None else None
    tokens = node_ids = kid_ids = None
    if into is not None:
        tokens, node_ids, kid_ids = into
        if tokens.shape[0] != batch or tokens.stride(-1) != 1 or kid_ids.shape != (nodes, m) or kid_ids.stride(-1) != 1:
            raise ValueError("draft_children_fused: into must be (tokens [R, N+1], nodes [K], kids [K, m])")
    _draft_children_kernel[(batch, nodes)](
        rows_ptr=rows,  # [R, W, V] q rows (or logits where every request is greedy), V contiguous
        row_index_ptr=row_index,  # [K] int64: which of the W rows of a request each node reads
        uniform_ptr=uniforms,  # [R, K, M] float64: one uniform per child draw (not read if ALL_GREEDY)
        greedy_ptr=greedy_flags,  # [R] int8 (read if HAS_GREEDY)
        out_ptr=out,  # [R, K, M] int64, written: the children's tokens, -1 where none exists
        tokens_ptr=tokens,  # [R, N+1] int64 token table (written if WRITE_TOKENS)
        node_ptr=node_ids,  # [K] int64: the nodes' ids in the table
        kid_ptr=kid_ids,  # [K, M] int64: their children's ids
        node_children_ptr=node_children,  # [R, K] int64: each node's own k_v (read if PER_NODE)
        stride_rr=rows.stride(0),
        stride_rw=rows.stride(1),
        stride_ur=uniforms.stride(0),
        stride_uk=uniforms.stride(1),
        stride_or=out.stride(0),
        stride_ok=out.stride(1),
        stride_tr=tokens.stride(0) if into is not None else 0,
        stride_kk=kid_ids.stride(0) if into is not None else 0,
        stride_nr=node_children.stride(0) if node_children is not None else 0,
        vocab=vocab,  # V
        SCHEME=SCHEMES[scheme],
        M=m,  # children per node
        SLOTS=slot_block(m),  # M rounded up to a power of 2
        HAS_GREEDY=greedy is not None,
        ALL_GREEDY=all_greedy,
        WRITE_TOKENS=into is not None,
        PER_NODE=node_children is not None,
        BLOCK_V=block_size(vocab),
    )
    return out


def top_tokens_fused(probs: torch.Tensor, k: int) -> torch.Tensor:
    """``drafting.top_tokens`` in one launch, without its host read: probs [..., V]
    (probabilities or logits, -inf allowed) -> LongTensor [..., k], the k largest
    by rank, ties to the lower id (each a pass over the row off the earlier winners)."""
    vocab = probs.shape[-1]
    rows = probs.reshape(-1, 1, vocab)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    first_row = torch.zeros(1, dtype=torch.long, device=probs.device)
    return draft_children_fused("chain", rows, first_row, k, all_greedy=True).view(*probs.shape[:-1], k)
