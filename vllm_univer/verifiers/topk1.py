"""What the ``topk1`` verifiers (greedy, univer) read off a node: the sampled
child r (slot 0), the top set T (slots 1..), and the residual draft q_bar that
r was drawn from."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..drafting import residual_draft
from ..ops import gather_tokens, token_set_mask
from .base import NodeBatch


@dataclass
class Topk1Node:
    sampled: torch.Tensor  # [B, n, 1] token of slot 0 (-1: the residual was empty)
    top: torch.Tensor  # [B, n, C-1] top tokens by rank (-1: missing)
    in_top: torch.Tensor  # [B, n, V] bool, membership in T
    q_bar: torch.Tensor  # [B, n, V] residual draft; all zero where slot 0 does not exist

    @classmethod
    def read(cls, nodes: NodeBatch) -> "Topk1Node":
        sampled, top = nodes.tokens[..., :1], nodes.tokens[..., 1:]
        in_top = token_set_mask(top, nodes.vocab_size, nodes.q.dtype)
        q_bar, _ = residual_draft(nodes.q, top)
        q_bar = q_bar * (sampled >= 0).to(q_bar.dtype)
        return cls(sampled, top, in_top, q_bar)

    def q_bar_at_sampled(self) -> torch.Tensor:
        return gather_tokens(self.q_bar, self.sampled)
