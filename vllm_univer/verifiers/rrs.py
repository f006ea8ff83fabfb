"""``rrs`` and ``rrsw``: recursive rejection sampling (SpecInfer), schemes ``iid`` / ``wor``.

At v: p' = p_v (and q' = q_v). For each child x in slot order: accept with
prob min(1, p'(x)/q'(x)) and descend; else p' <- norm([p' - q']+) and, for
``rrsw`` only, q' <- norm(q' with q'(x) = 0). All rejected: Y ~ p'.
"""

from __future__ import annotations

import torch

from ..ops import clipped_ratio, drop_token_, gather_tokens, positive_difference, safe_ratio
from .base import Family, NodeBatch, NodeOutput, TreeVerifier


class RecursiveRejectionVerifier(TreeVerifier):
    """SpecInfer's multi-draft rejection sampling; ``without_replacement`` selects RRSw."""

    family = Family.DESCENT

    def __init__(self, without_replacement: bool):
        self.without_replacement = without_replacement
        self.name = "rrsw" if without_replacement else "rrs"
        self.scheme = "wor" if without_replacement else "iid"

    def node_rule(self, nodes: NodeBatch, want_residual: bool) -> NodeOutput:
        # p' = P / M and q' = Q / N are kept unnormalised, so that a rejection is one
        # fused pass, P <- [P - (M / N) Q]+ (= M' norm([p' - q']+)), plus for rrsw
        # Q(x) <- 0 and N <- sum Q. P and Q are working copies: the inputs stay untouched.
        # The rows are distributions, so M = N = 1 before the first rejection.
        p = nodes.p
        q = nodes.q.clone() if self.without_replacement else nodes.q
        work = torch.empty_like(p)
        rows, p_mass, q_mass = p, p.new_ones(p.shape[:-1] + (1,)), p.new_ones(p.shape[:-1] + (1,))
        alphas = []
        for j in range(nodes.tokens.shape[-1]):  # child slots; nodes stay batched
            xj = nodes.tokens[..., j:j + 1]
            exists = xj >= 0
            alphas.append(clipped_ratio(gather_tokens(rows, xj) / torch.where(p_mass > 0, p_mass, 1.0),
                                        gather_tokens(q, xj) / torch.where(q_mass > 0, q_mass, 1.0)).squeeze(-1))
            # Rejecting x. The residual is empty only when alpha = 1 (this rejection has
            # probability 0); then p' stays empty and is never read.
            coef = torch.where(exists, safe_ratio(p_mass, q_mass), 0.0)
            p_mass = torch.where(exists, positive_difference(rows, 1, q, coef, out=work), p_mass)
            rows = work
            if self.without_replacement:
                q_mass = torch.where(exists, drop_token_(q, xj, exists), q_mass)
        return NodeOutput(torch.stack(alphas, -1), None, rows if want_residual else None)
