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


# Masses without cancellation. A mass off a set of tokens is a masked sum over the
# tokens off the set, never the row's total minus the set's part: when the set holds
# all but ~1e-16 of a row (float64; ~6e-8 in float32) the difference cancels to 0 or
# to rounding noise, and a ratio divided by it (the sampled child's p / q_bar, a
# child's share of what is left) turns into a certainty. Sums of non-negative terms
# are accurate relative to their own size, so every mass built from them is too. On
# CPU the chunks are accumulated in float64 (float32 rows included); elsewhere one
# pass in the rows' dtype (a pairwise tree reduction: relative error about
# log2(V) eps). The fused kernels do the same in float64
# (``kernels/triton_topk1_verify``: ``_row_masses``, ``_excess_sum``).


def token_slice_mask(tokens: torch.Tensor, part: slice) -> torch.Tensor:
    """tokens [..., k] (-1 allowed) -> BoolTensor [..., part]: True at the ids of the
    vocabulary slice ``part`` that are listed. One scatter into a row one longer than
    the slice: -1 and listed ids outside the slice land on the spare last entry, so
    repeats and placeholders never clear a listed id."""
    width = part.stop - part.start
    local = tokens if part.start == 0 else tokens - part.start
    local = local.clamp(-1, width).remainder_(width + 1)  # -1 -> width (the spare entry)
    listed = torch.zeros(*tokens.shape[:-1], width + 1, dtype=torch.bool, device=tokens.device)
    return listed.scatter_(-1, local, True)[..., :width]


def token_set_mask(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """tokens [..., k] (-1 allowed, repeats allowed) -> BoolTensor [..., V]: True at
    every listed token (``token_slice_mask`` over the whole vocabulary)."""
    return token_slice_mask(tokens, slice(0, vocab_size))


def _chunk_sum(x: torch.Tensor) -> torch.Tensor:
    # [..., v] -> [..., 1], float64 accumulation on CPU (no [.., V] float64 elsewhere).
    if x.device.type == "cpu":
        return x.sum(-1, keepdim=True, dtype=torch.float64)
    return x.sum(-1, keepdim=True)


def mass_off(rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """sum_{y not in tokens} rows(y) -> [..., 1] (rows [..., V] >= 0, tokens [..., k], -1
    allowed), a masked sum: exact to the rows' rounding however small the mass."""
    total = None
    for part in vocab_slices(rows):
        mass = _chunk_sum(rows[..., part].masked_fill(token_slice_mask(tokens, part), 0))
        total = mass if total is None else total.add_(mass)
    return total.to(rows.dtype)


def excess_off(
    p: torch.Tensor, p_scale: torch.Tensor, q: torch.Tensor, q_mass: torch.Tensor, tokens: torch.Tensor
) -> torch.Tensor:
    """sum_{y not in tokens} [s p(y) - q(y) / q_mass]+ -> [..., 1], s = p_scale: the mass
    a residual [s p - q_bar]+ keeps off a set (q_bar = q / q_mass, a residual draft), as
    a masked sum of its own terms (never s p(off set) minus what q_bar covers).
    p, q [..., V]; p_scale, q_mass broadcast against [..., 1]; q_mass = inf gives q_bar = 0."""
    total = None
    for part in vocab_slices(q):
        excess = torch.mul(p[..., part], p_scale).sub_(q[..., part] / q_mass).clamp_(min=0)
        mass = _chunk_sum(excess.masked_fill_(token_slice_mask(tokens, part), 0))
        total = mass if total is None else total.add_(mass)
    return total.to(q.dtype)


def reverse_cumsum(x: torch.Tensor) -> torch.Tensor:
    """sum_{i >= j} x_i along the last dim: what is left from slot j on, as a sum of
    the parts left (not a total minus the parts used)."""
    return x.flip(-1).cumsum(-1).flip(-1)


def safe_ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den where den > 0, else 0, clamped to the dtype's largest finite value
    (a coefficient that may multiply zeros: never inf, never NaN)."""
    ratio = torch.where(den > 0, num / den, 0.0)
    return ratio.clamp_(max=torch.finfo(ratio.dtype).max)
