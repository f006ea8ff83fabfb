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
    # Four launches, no comparison or where(). A den rounded below 0 counts as 0; x/0 is
    # +-inf (the sign of the zero) -> 1, 0/0 is NaN -> 0.
    ratio = num / den.clamp(min=0.0)
    return ratio.nan_to_num_(nan=0.0, posinf=1.0, neginf=1.0).clamp_(max=1.0)


def stop_prob(mass: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """h = mass / (mass + 1 - scale), the probability of stopping at a node whose
    residual carries ``mass`` and whose prefix scale is ``scale``; 1 where the
    denominator is 0 (Block Verification's convention)."""
    den = mass + (1.0 - scale)
    return torch.where(den > 0, mass / den, 1.0).clamp_(0.0, 1.0)


# Elements of one chunk's temporaries on CPU (1 MB of float32): small enough to be
# reused by the allocator, unlike fresh [.., V] temporaries that are page-faulted in,
# and to keep a chunk's consecutive steps in cache (4 MB chunks ran the rejection
# replays 3x slower on the 2-core EPYC this was tuned on).
_CPU_CHUNK_ELEMENTS = 1 << 18


def vocab_slices(rows: torch.Tensor) -> list[slice]:
    """The vocabulary chunks a pass over ``rows`` [..., V] walks: about 1 MB of
    float32 each on CPU, the whole row elsewhere (one pass per step) and while
    ``torch.compile`` traces (its fused loops keep no [.., V] temporaries to chunk)."""
    vocab = rows.shape[-1]
    if rows.device.type != "cpu" or torch.compiler.is_compiling():
        return [slice(0, vocab)]
    chunk = max(1024, _CPU_CHUNK_ELEMENTS // max(1, rows.numel() // max(vocab, 1)))
    return [slice(start, min(start + chunk, vocab)) for start in range(0, vocab, chunk)]


def sum_of_min(a: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    """sum_y min(a(y), b_scale * b(y)) over the last dim.

    a, b [..., V]; b_scale broadcasts against [..., 1] -> [..., 1]. On CPU the
    vocabulary is walked in chunks (no [.., V] temporary); elsewhere one pass.
    """
    total = None
    for part in vocab_slices(a):
        mass = torch.minimum(a[..., part], b[..., part] * b_scale).sum(-1, keepdim=True)
        total = mass if total is None else total.add_(mass)
    return total


def safe_ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den where den > 0, else 0, clamped to the dtype's largest finite value
    (a coefficient that may multiply zeros: never inf, never NaN)."""
    ratio = torch.where(den > 0, num / den, 0.0)
    return ratio.clamp_(max=torch.finfo(ratio.dtype).max)


def exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    """Cumulative sum along the last dim, excluding the current element."""
    return x.cumsum(-1) - x
