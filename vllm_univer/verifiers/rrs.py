"""``rrs`` and ``rrsw``: recursive rejection sampling (SpecInfer), schemes ``iid`` / ``wor``.

At v: p' = p_v (and q' = q_v). For each child x in slot order: accept with
prob min(1, p'(x)/q'(x)) and descend; else p' <- norm([p' - q']+) and, for
``rrsw`` only, q' <- norm(q' with q'(x) = 0). All rejected: Y ~ p'.
"""

from __future__ import annotations

import torch

from ..ops import clipped_ratio, gather_tokens, remove_token_, replace_by_residual_
from .base import Family, NodeBatch, NodeOutput, TreeVerifier


class RecursiveRejectionVerifier(TreeVerifier):
    """SpecInfer's multi-draft rejection sampling; ``without_replacement`` selects RRSw."""

    family = Family.DESCENT

    def __init__(self, without_replacement: bool):
        self.without_replacement = without_replacement
        self.name = "rrsw" if without_replacement else "rrs"
        self.scheme = "wor" if without_replacement else "iid"

    def node_rule(self, nodes: NodeBatch, want_residual: bool) -> NodeOutput:
        # Working copies updated in place, slot by slot (the inputs stay untouched).
        p = nodes.p.clone()
        q = nodes.q.clone() if self.without_replacement else nodes.q
        work = torch.empty_like(p)
        alphas = []
        for j in range(nodes.tokens.shape[-1]):  # child slots; nodes stay batched
            xj = nodes.tokens[..., j:j + 1]
            exists = xj >= 0
            alphas.append(clipped_ratio(gather_tokens(p, xj), gather_tokens(q, xj)).squeeze(-1))
            # Rejecting x: the residual has zero mass only when alpha = 1, i.e. when
            # this rejection has probability 0; keep p' then (no division by zero).
            replace_by_residual_(p, q, 1.0, exists, work)
            if self.without_replacement:
                remove_token_(q, xj, exists)
        return NodeOutput(torch.stack(alphas, -1), None, p if want_residual else None)
