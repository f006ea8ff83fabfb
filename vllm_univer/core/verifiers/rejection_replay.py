"""A node's run of rejections (rrs, rrsw, traversal), replayed from p and q.

Rejecting child x_i turns the node's unnormalised target row R_i and draft row
Q_i into

    R_{i+1} = [a_i R_i - c_i Q_i]+        Q_{i+1} = Q_i with Q(x_i) = 0 (or Q_i),

from R_0 = p and Q_0 = q. The rules only ever need the rows' sums and their
values at the next child, so the rows are never stored: ``masses`` replays the
steps on one vocabulary chunk at a time (on CPU the chunk's steps run in cache;
one read of p and q per call, no [.., V] writes) and ``at`` replays them on the
gathered columns of a few tokens.

Q_i is not built either: it differs from q only at the removed tokens, where
Q_i = 0 makes the step R_{i+1}(x) = a_i R_i(x); that one value per row is put
back after each step. The sums of Q_j come from q's block sums with the blocks
of the removed tokens summed again without them (``BlockCdf.total``; one more
read of q per node rule), not from q's sum less the removed values, which would
cancel the rest away when a removed token held most of q.
"""

from __future__ import annotations

import torch

from ..inverse_cdf import BlockCdf
from ..ops import gather_tokens, vocab_slices


class RejectionReplay:
    """Rejection steps at n nodes of B requests: p, q [B, n, V]; per step a_i (a
    number or [B, n, 1]), c_i [B, n, 1] (finite, >= 0) and the rejected token x_i
    [B, n, 1] (-1: none)."""

    def __init__(self, p: torch.Tensor, q: torch.Tensor, removes_tokens: bool):
        self.p, self.q = p, q
        self.removes_tokens = removes_tokens
        self.steps: list[tuple] = []
        self._q_blocks = None  # q's block sums, for the sums of Q_j

    def reject(self, rows_scale, draft_scale: torch.Tensor, token: torch.Tensor) -> None:
        self.steps.append((rows_scale, draft_scale, token))

    def at(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """R_j and Q_j (j = steps so far) at ``tokens`` [B, n, k] (-1: 0) -> two [B, n, k]."""
        rows, draft = gather_tokens(self.p, tokens), gather_tokens(self.q, tokens)
        removed = torch.zeros_like(tokens, dtype=torch.bool)  # Q = 0 there from the next step on
        for rows_scale, draft_scale, token in self.steps:
            rows = torch.where(removed, rows * rows_scale, _reject(rows, draft, rows_scale, draft_scale))
            if self.removes_tokens:
                removed |= (tokens == token) & (token >= 0)
        return rows, torch.where(removed, 0.0, draft)

    def masses(self, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(sum R_j, sum Q_j) [B, n, 1] (sum Q_j only when tokens are removed: else
        Q_j = q); R_j is also written into ``out`` [B, n, V] if given."""
        removed = [token for _, _, token in self.steps] if self.removes_tokens else []
        r_mass = None
        for part in vocab_slices(self.p):
            width = part.stop - part.start
            offsets = [(x - part.start, (x >= part.start) & (x < part.stop)) for x in removed]
            rows = self.p[..., part]
            draft = self.q[..., part]
            for i, (rows_scale, draft_scale, _) in enumerate(self.steps):
                before = rows
                rows = _reject(rows, draft, rows_scale, draft_scale)
                for offset, inside in offsets[:i]:  # Q_i = 0 at the tokens removed so far
                    index = offset.clamp(0, width - 1)
                    kept = torch.where(inside, before.gather(-1, index) * rows_scale, rows.gather(-1, index))
                    rows.scatter_(-1, index, kept)
            if out is not None:
                out[..., part] = rows
            r_part = rows.sum(-1, keepdim=True)
            r_mass = r_part if r_mass is None else r_mass.add_(r_part)
        if not self.removes_tokens:
            return r_mass, None
        if self._q_blocks is None:
            self._q_blocks = BlockCdf(self.q)
        return r_mass, self._q_blocks.total(exclude=torch.cat(removed, -1) if removed else None)


def _reject(rows: torch.Tensor, draft: torch.Tensor, rows_scale, draft_scale: torch.Tensor) -> torch.Tensor:
    """One rejection step, [a R - c Q]+, as a new tensor (the same arithmetic for the
    vocabulary chunks of ``masses`` and the gathered columns of ``at``)."""
    if isinstance(rows_scale, (int, float)) and rows_scale == 1:
        return torch.addcmul(rows, draft, draft_scale, value=-1).clamp_(min=0)
    return torch.mul(rows, rows_scale).addcmul_(draft, draft_scale, value=-1).clamp_(min=0)
