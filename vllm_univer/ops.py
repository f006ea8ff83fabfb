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
# reused by the allocator, unlike fresh [.., V] temporaries that are page-faulted in,
# and to keep a chunk's consecutive steps in cache.
_CPU_CHUNK_ELEMENTS = 1 << 20


def _vocab_chunk(rows: torch.Tensor) -> int:
    """Columns per chunk of a vocabulary walk: the whole row off CPU (one pass per step)."""
    vocab = rows.shape[-1]
    if rows.device.type != "cpu":
        return vocab
    return max(1024, _CPU_CHUNK_ELEMENTS // max(1, rows.numel() // max(vocab, 1)))


def sum_of_min(a: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    """sum_y min(a(y), b_scale * b(y)) over the last dim.

    a, b [..., V]; b_scale broadcasts against [..., 1] -> [..., 1]. On CPU the
    vocabulary is walked in chunks (no [.., V] temporary); elsewhere one pass.
    """
    vocab, chunk = a.shape[-1], _vocab_chunk(a)
    if chunk >= vocab:
        return torch.minimum(a, b * b_scale).sum(-1, keepdim=True)
    total = None
    for start in range(0, vocab, chunk):
        end = start + chunk
        part = torch.minimum(a[..., start:end], b[..., start:end] * b_scale).sum(-1, keepdim=True)
        total = part if total is None else total.add_(part)
    return total


def positive_difference(rows: torch.Tensor, rows_scale, other: torch.Tensor, other_scale: torch.Tensor,
                        out: torch.Tensor) -> torch.Tensor:
    """out <- [rows_scale * rows - other_scale * other]+ -> its sum over the last dim [..., 1].

    rows, other, out [..., V] (``out`` may be ``rows``: in place); rows_scale a number
    or a tensor and other_scale a tensor, both broadcasting against [..., 1] and
    finite. On CPU the vocabulary is walked in chunks, so each chunk's steps run
    on data in cache; elsewhere each step is one pass.
    """
    vocab, chunk = rows.shape[-1], _vocab_chunk(rows)
    total = None
    for start in range(0, vocab, chunk):
        part = slice(start, start + chunk)
        dest = out[..., part]
        if isinstance(rows_scale, (int, float)) and rows_scale == 1:
            torch.addcmul(rows[..., part], other[..., part], other_scale, value=-1, out=dest)
        else:
            torch.mul(rows[..., part], rows_scale, out=dest).addcmul_(other[..., part], other_scale, value=-1)
        mass = dest.clamp_(min=0).sum(-1, keepdim=True)
        total = mass if total is None else total.add_(mass)
    return total


def safe_ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den where den > 0, else 0, clamped to the dtype's largest finite value
    (a coefficient that may multiply zeros: never inf, never NaN)."""
    ratio = torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(num))
    return ratio.clamp(max=torch.finfo(ratio.dtype).max)


def drop_token_(rows: torch.Tensor, token: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """In place, on the rows where ``where``: rows(token) <- 0 -> the rows' sums [..., 1]
    (summed again, not by subtraction: no cancellation when the token held most of a row).
    rows [..., V], token and where [..., 1] (token may be -1 where not ``where``)."""
    index = token.clamp(min=0)
    rows.scatter_(-1, index, rows.gather(-1, index) * ~where)
    return rows.sum(-1, keepdim=True)


def exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    """Cumulative sum along the last dim, excluding the current element."""
    return x.cumsum(-1) - x
