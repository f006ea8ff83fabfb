"""``rrs`` and ``rrsw``: recursive rejection sampling (SpecInfer), schemes ``iid`` / ``wor``.

At v: p' = p_v (and q' = q_v). For each child x in slot order: accept with
prob min(1, p'(x)/q'(x)) and descend; else p' <- norm([p' - q']+) and, for
``rrsw`` only, q' <- norm(q' with q'(x) = 0). All rejected: Y ~ p'.
"""

from __future__ import annotations

import torch

from ..ops import clipped_ratio, gather_tokens, normalize, one_token_mask
from .base import Family, NodeBatch, NodeOutput, TreeVerifier


class RecursiveRejectionVerifier(TreeVerifier):
    """SpecInfer's multi-draft rejection sampling; ``without_replacement`` selects RRSw."""

    family = Family.DESCENT

    def __init__(self, without_replacement: bool):
        self.without_replacement = without_replacement
        self.name = "rrsw" if without_replacement else "rrs"
        self.scheme = "wor" if without_replacement else "iid"

    def node_rule(self, nodes: NodeBatch, want_residual: bool) -> NodeOutput:
        p, q = nodes.p, nodes.q
        alphas = []
        for j in range(nodes.tokens.shape[-1]):  # child slots; nodes stay batched
            x = nodes.tokens[..., j]
            exists = (x >= 0).unsqueeze(-1)
            alpha = clipped_ratio(gather_tokens(p, x.unsqueeze(-1)), gather_tokens(q, x.unsqueeze(-1)))
            alphas.append(alpha.squeeze(-1))
            # Rejecting x: the residual has zero mass only when alpha = 1, i.e. when
            # this rejection has probability 0; keep p' then (no division by zero).
            new_p, mass = normalize((p - q).clamp(min=0))
            p = torch.where(exists & (mass > 0).unsqueeze(-1), new_p, p)
            if self.without_replacement:
                new_q, _ = normalize(q.masked_fill(one_token_mask(x, nodes.vocab_size), 0))
                q = torch.where(exists, new_q, q)
        return NodeOutput(torch.stack(alphas, -1), None, p if want_residual else None)
