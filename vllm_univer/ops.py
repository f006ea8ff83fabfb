"""Small tensor helpers shared by the draft schemes and verifiers.

All functions work on the last dimension (the vocabulary) and broadcast over any
leading batch/node dimensions. Token ids of -1 mean "no token" everywhere.
"""

from __future__ import annotations

import torch


def gather_tokens(rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """rows [..., V], tokens [..., k] (-1 allowed) -> rows at tokens [..., k] (0 where token is -1)."""
    vals = rows.gather(-1, tokens.clamp(min=0))
    return vals.masked_fill(tokens < 0, 0)


def token_set_mask(tokens: torch.Tensor, vocab_size: int, dtype: torch.dtype) -> torch.Tensor:
    """tokens [..., k] (-1 allowed) -> BoolTensor [..., V]: True at every listed token.

    Built with scatter_add so repeated tokens and -1 placeholders (routed to id 0
    with weight 0) never overwrite one another.
    """
    counts = torch.zeros(*tokens.shape[:-1], vocab_size, dtype=dtype, device=tokens.device)
    counts.scatter_add_(-1, tokens.clamp(min=0), (tokens >= 0).to(dtype))
    return counts > 0


def normalize(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [..., V] >= 0 -> (rows / sum, sum [...]); rows with sum 0 stay all-zero."""
    total = rows.sum(-1)
    safe = torch.where(total > 0, total, torch.ones_like(total))
    return rows / safe.unsqueeze(-1), total


def clipped_ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """min(1, num / den) for num, den >= 0, with x/0 = 1 for x > 0 and 0/0 = 0."""
    safe = torch.where(den > 0, den, torch.ones_like(den))
    ratio = torch.where(den > 0, num / safe, (num > 0).to(num.dtype))
    return ratio.clamp(max=1.0)


def continue_prob(mass: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """h = mass / (mass + 1 - scale), the probability of stopping at a node whose
    residual carries ``mass`` and whose prefix scale is ``scale``; 1 where the
    denominator is 0 (Block Verification's convention)."""
    den = mass + (1.0 - scale)
    safe = torch.where(den > 0, den, torch.ones_like(den))
    return torch.where(den > 0, mass / safe, torch.ones_like(den)).clamp(0.0, 1.0)


# Elements of one chunk's temporaries on CPU (4 MB of float32): small enough to be
# reused by the allocator, unlike fresh [.., V] temporaries that are page-faulted in.
_CPU_CHUNK_ELEMENTS = 1 << 20


def sum_of_min(a: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    """sum_y min(a(y), b_scale * b(y)) over the last dim.

    a, b [..., V]; b_scale broadcasts against [..., 1] -> [..., 1]. On CPU the
    vocabulary is walked in chunks (no [.., V] temporary); elsewhere one pass.
    """
    vocab = a.shape[-1]
    rows = max(1, a.numel() // max(vocab, 1))
    chunk = vocab if a.device.type != "cpu" else max(1024, _CPU_CHUNK_ELEMENTS // rows)
    if chunk >= vocab:
        return torch.minimum(a, b * b_scale).sum(-1, keepdim=True)
    total = None
    for start in range(0, vocab, chunk):
        end = start + chunk
        part = torch.minimum(a[..., start:end], b[..., start:end] * b_scale).sum(-1, keepdim=True)
        total = part if total is None else total.add_(part)
    return total


def replace_by_residual_(rows: torch.Tensor, draft: torch.Tensor, scale, where: torch.Tensor,
                         work: torch.Tensor) -> torch.Tensor:
    """In place: rows <- norm([scale * rows - draft]+) on the rows where ``where`` and
    the residual has mass (elsewhere they stay as they are) -> the residual's mass [..., 1].

    rows, draft, work [..., V] (``work`` is scratch space); scale a number or a tensor
    broadcasting against [..., 1]; where [..., 1] bool."""
    torch.mul(rows, scale, out=work)
    work.sub_(draft).clamp_(min=0)
    mass = work.sum(-1, keepdim=True)
    work.div_(torch.where(mass > 0, mass, torch.ones_like(mass)))
    torch.where(where & (mass > 0), work, rows, out=rows)
    return mass


def remove_token_(rows: torch.Tensor, token: torch.Tensor, where: torch.Tensor) -> None:
    """In place, on the rows where ``where``: rows(token) <- 0, then the row renormalised
    (a row left with no mass stays all zero). rows [..., V], token and where [..., 1]
    (token may be -1 where not ``where``)."""
    index = token.clamp(min=0)
    rows.scatter_(-1, index, rows.gather(-1, index) * ~where)
    total = rows.sum(-1, keepdim=True)
    rows.div_(torch.where(where & (total > 0), total, torch.ones_like(total)))


def exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    """Cumulative sum along the last dim, excluding the current element."""
    return x.cumsum(-1) - x


def sample_from_weights(weights: torch.Tensor, generator: torch.Generator | None = None,
                        block: int = 1024) -> torch.Tensor:
    """One index per row of ``weights`` [B, V] >= 0, drawn with P(i) = w_i / sum(w).

    Inverse CDF in two stages, so that no [B, V] float64 cumulative sum is built:
    u ~ U[0, 1) picks the block of ``block`` tokens whose cumulative block sums
    (float64) bracket u * sum(w), then the token inside that block from the
    block's own float64 cumulative sum. Each block's sum is accumulated in the
    weights' dtype: exact to ~1e-16 for float64 weights, to ~1e-7 relative (the
    precision of the float32 weights themselves) for float32 ones. A zero-weight
    token (or block) never has a cumulative sum above the previous one and can
    never be picked. No host sync.
    """
    rows, vocab = weights.shape
    full = vocab // block
    sums = [weights[:, :full * block].view(rows, full, block).sum(-1)] if full else []
    if full * block < vocab:
        sums.append(weights[:, full * block:].sum(-1, keepdim=True))
    block_cdf = torch.cat(sums, -1).to(torch.float64).cumsum(-1)  # [B, blocks]
    total = block_cdf[:, -1:].contiguous()
    u = torch.rand(total.shape, generator=generator, device=weights.device, dtype=torch.float64)
    target = u * total
    # The block: the first whose cumulative sum exceeds the target; u * total can
    # round up to the total (probability ~2^-53): cap at the last block of positive weight.
    chosen = torch.minimum(torch.searchsorted(block_cdf, target, right=True),
                           torch.searchsorted(block_cdf, total, right=False))  # [B, 1]
    before = torch.where(chosen > 0, block_cdf.gather(1, (chosen - 1).clamp(min=0)), torch.zeros_like(target))
    # The chosen block's tokens (the last block may be short: pad its columns with zero weight).
    columns = chosen * block + torch.arange(block, device=weights.device)  # [B, block]
    inside = columns < vocab
    inner = weights.gather(1, columns.clamp(max=vocab - 1)).masked_fill(~inside, 0)
    inner_cdf = inner.to(torch.float64).cumsum(-1)
    # Inside the block the same rule; rounding between the two sums can put the
    # remainder at or past the block's end: cap at its last token of positive weight.
    remainder = (target - before).clamp(min=0)
    offset = torch.minimum(torch.searchsorted(inner_cdf, remainder, right=True),
                           torch.searchsorted(inner_cdf, inner_cdf[:, -1:].contiguous(), right=False))
    return (chosen * block + offset).squeeze(-1)
