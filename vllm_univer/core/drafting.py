"""Draft schemes: how the proposer picks the children of a node from its draft row q.

| scheme  | children, in slot order                                         |
|---------|-----------------------------------------------------------------|
| chain   | one token x ~ q                                                 |
| iid     | m tokens i.i.d. from q                                          |
| wor     | m tokens without replacement, in sampling order                 |
| topk1   | slot 0 r ~ residual q off Top_{m-1}(q); slots 1.. the top tokens |

A child that cannot exist (``wor`` past the support of q, ``topk1`` slot 0 when
the top tokens carry all of q's mass) is -1.
"""

from __future__ import annotations

import torch

from .inverse_cdf import BlockCdf

SCHEMES = ("chain", "iid", "wor", "topk1")


def top_tokens(probs: torch.Tensor, k: int) -> torch.Tensor:
    """probs [..., V] -> LongTensor [..., k]: the k most likely tokens by rank, ties to the lower id."""
    if k == 0:
        return probs.new_empty(probs.shape[:-1] + (0,), dtype=torch.long)
    if k == 1:
        return probs.argmax(-1, keepdim=True)  # argmax returns the first (lowest-id) maximum
    vocab = probs.shape[-1]
    from .fused_tree_pass import triton_reads  # here: fused_tree_pass imports the verifiers, which import this

    if k < vocab and triton_reads(probs):
        # One launch and no host read: the check below would stall the device mid-step.
        from .kernels.triton_draft_children import top_tokens_fused

        return top_tokens_fused(probs, k)
    # topk does not promise an order among equal values. Take the k+1 largest: if
    # the k-th and (k+1)-th values differ, the chosen set is exact and only ties
    # inside it need ordering; rows with a tie across the boundary (common in
    # bfloat16 logits) are resolved exactly over their whole row. One host sync
    # (free where the tensors are host memory), and only for k >= 2.
    vals, idx = torch.topk(probs, min(k + 1, vocab), dim=-1)
    boundary_tie = vals[..., k - 1] == vals[..., k] if vocab > k else None
    vals, idx = vals[..., :k], idx[..., :k]
    by_id = torch.sort(idx, dim=-1).indices
    vals, idx = vals.gather(-1, by_id), idx.gather(-1, by_id)
    order = torch.sort(vals, dim=-1, descending=True, stable=True).indices  # ids ascending within ties
    top = idx.gather(-1, order)
    if boundary_tie is not None and bool(boundary_tie.any()):
        top[boundary_tie] = _top_tokens_exact(probs[boundary_tie], k)
    return top


def _top_tokens_exact(probs: torch.Tensor, k: int) -> torch.Tensor:
    """``top_tokens`` by full-width passes: every token above the k-th value, then
    the lowest ids among the tokens equal to it, then the k winners in rank order."""
    kth = torch.topk(probs, k, dim=-1).values[..., -1:]  # [..., 1]
    above = probs > kth
    tied = probs == kth
    need = k - above.sum(-1, keepdim=True)
    chosen = above | (tied & (tied.cumsum(-1) <= need))
    vocab = probs.shape[-1]
    ids = torch.arange(vocab, device=probs.device)
    picked = torch.topk(torch.where(chosen, ids, vocab), k, dim=-1, largest=False).values  # k smallest ids
    vals = probs.gather(-1, picked)
    order = torch.sort(vals, dim=-1, descending=True, stable=True).indices  # ids ascending within ties
    return picked.gather(-1, order)


def draft_children(
    scheme: str,
    probs: torch.Tensor,
    num_children: int,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Draw the children of K nodes.

    Args:
        scheme: one of ``SCHEMES``.
        probs: FloatTensor [K, V] (or [R, K, V]), the draft distribution q of each
            node; it may be a non-contiguous view and is not written to.
        num_children: m >= 1 (``chain`` takes m = 1 only).
        generator: optional torch.Generator for reproducibility.

    Returns:
        LongTensor [K, m] (or [R, K, m]) of child tokens in slot order, -1 where a
        child does not exist. Every scheme reads the rows once (``BlockCdf``) and
        ``topk1`` once more for its top tokens; the m draws cost O(V / block + block) each.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"unknown draft scheme {scheme!r}; choose one of {SCHEMES}")
    if probs.dim() not in (2, 3):
        raise ValueError(f"probs must be [K, V] or [R, K, V], got shape {tuple(probs.shape)}")
    m = int(num_children)
    vocab = probs.shape[-1]
    if m < 1:
        raise ValueError(f"num_children must be >= 1, got {m}")
    if scheme == "chain" and m != 1:
        raise ValueError(f"scheme 'chain' draws exactly one child per node, got num_children={m}")
    if scheme in ("wor", "topk1") and m > vocab:
        raise ValueError(f"scheme {scheme!r} cannot draw {m} distinct children from a vocabulary of {vocab}")

    cdf = BlockCdf(probs)
    if scheme in ("chain", "iid"):
        return torch.stack([cdf.draw(generator) for _ in range(m)], -1)

    if scheme == "wor":
        # Sequential sampling without replacement, its definition: child j ~ q
        # restricted to the tokens not drawn yet (-1 once the support is used up).
        kids = probs.new_empty(probs.shape[:-1] + (0,), dtype=torch.long)
        for _ in range(m):
            kids = torch.cat([kids, cdf.draw(generator, exclude=kids).unsqueeze(-1)], -1)
        return kids

    # topk1: slot 0 from q off the top set (q_bar, the residual draft; the inverse
    # CDF needs no normalisation), -1 when the top set holds all of q.
    top = top_tokens(probs, m - 1)
    return torch.cat([cdf.draw(generator, exclude=top).unsqueeze(-1), top], dim=-1)
