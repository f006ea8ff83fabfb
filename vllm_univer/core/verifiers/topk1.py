"""What the ``topk1`` verifiers (greedy, univer) read off a node: the sampled
child r (slot 0), the top set T (slots 1..), and the residual draft
q_bar = q off T / q(off T) that r was drawn from.

The level pass needs only sums over q_bar: masked sums off T (``ops.mass_off``,
``ops.excess_off``), never a total minus the top tokens' part, so a
draft whose top tokens hold all but 1e-30 of its mass is verified as exactly as
any other. The residual rows are built only for the nodes a step ends at.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops import excess_off, gather_tokens, mass_off, token_set_mask
from .base import NodeBatch


@dataclass
class Topk1Node:
    sampled: torch.Tensor  # [B, n, 1] token of slot 0 (-1: the residual was empty)
    top: torch.Tensor  # [B, n, C-1] top tokens by rank (-1: missing)
    p_top: torch.Tensor  # [B, n, C-1] p at the top tokens (0 where missing)
    q_off_top: torch.Tensor  # [B, n, 1] q's mass off T (1 where slot 0 does not exist)
    has_sampled: torch.Tensor  # [B, n, 1] bool

    @classmethod
    def read(cls, nodes: NodeBatch) -> Topk1Node:
        sampled, top = nodes.tokens[..., :1], nodes.tokens[..., 1:]
        q_off = mass_off(nodes.q, top)
        has_sampled = (sampled >= 0) & (q_off > 0)
        q_off = torch.where(has_sampled, q_off, torch.ones_like(q_off))
        return cls(sampled, top, gather_tokens(nodes.p, top), q_off, has_sampled)

    def q_bar_at(self, nodes: NodeBatch, tokens: torch.Tensor) -> torch.Tensor:
        """q_bar at tokens [B, n, k] that lie off T (the sampled token)."""
        return gather_tokens(nodes.q, tokens) / self.q_off_top * self.has_sampled

    def residual_mass(self, nodes: NodeBatch, scale: torch.Tensor) -> torch.Tensor:
        """rho = sum_{y not in T} [scale p(y) - q_bar(y)]+ -> [B, n, 1], one masked pass
        over V (without a sampled child q_bar = 0: rho = scale p(off T))."""
        q_mass = torch.where(self.has_sampled, self.q_off_top, torch.full_like(self.q_off_top, float("inf")))
        return excess_off(nodes.p, scale, nodes.q, q_mass, self.top)

    def residual_rows(self, nodes: NodeBatch, scale: torch.Tensor) -> torch.Tensor:
        """[scale * p - q_bar]+ off T, 0 on T -> [B, n, V] (built only for end nodes)."""
        q_bar = nodes.q / self.q_off_top * self.has_sampled
        in_top = token_set_mask(self.top, nodes.vocab_size)
        return (scale * nodes.p - q_bar).clamp(min=0).masked_fill(in_top, 0)
