"""``rrs`` and ``rrsw``: recursive rejection sampling (SpecInfer), schemes ``iid`` / ``wor``.

At v: p' = p_v (and q' = q_v). For each child x in slot order: accept with
prob min(1, p'(x)/q'(x)) and descend; else p' <- norm([p' - q']+) and, for
``rrsw`` only, q' <- norm(q' with q'(x) = 0). All rejected: Y ~ p'.
"""

from __future__ import annotations

import torch

from ..ops import clipped_ratio, safe_ratio
from .base import Family, NodeBatch, NodeOutput, TreeVerifier
from .rejection_replay import RejectionReplay


class RecursiveRejectionVerifier(TreeVerifier):
    """SpecInfer's multi-draft rejection sampling; ``without_replacement`` selects RRSw."""

    family = Family.DESCENT

    def __init__(self, without_replacement: bool):
        self.without_replacement = without_replacement
        self.name = "rrsw" if without_replacement else "rrs"
        self.scheme = "wor" if without_replacement else "iid"

    def node_rule(self, nodes: NodeBatch, want_residual: bool) -> NodeOutput:
        # p' = R / M and q' = Q / N, unnormalised: rejecting x is R <- [R - (M / N) Q]+
        # (= M' norm([p' - q']+)) and, for rrsw, Q(x) <- 0. The rows are distributions,
        # so M = N = 1 before the first rejection; later masses come from a replay.
        replay = RejectionReplay(nodes.p, nodes.q, removes_tokens=self.without_replacement)
        ones = nodes.p.new_ones(nodes.tokens.shape[:-1] + (1,))
        p_mass, q_mass = ones, ones
        alphas = []
        for j in range(nodes.tokens.shape[-1]):  # child slots; nodes stay batched
            xj = nodes.tokens[..., j : j + 1]
            exists = xj >= 0
            if j > 0:
                p_mass, removed_q_mass = replay.masses()
                q_mass = q_mass if removed_q_mass is None else removed_q_mass
            p_x, q_x = replay.at(xj)
            alphas.append(
                clipped_ratio(
                    p_x / torch.where(p_mass > 0, p_mass, 1.0), q_x / torch.where(q_mass > 0, q_mass, 1.0)
                ).squeeze(-1)
            )
            # The residual is empty only when alpha = 1 (this rejection has probability 0).
            replay.reject(1, torch.where(exists, safe_ratio(p_mass, q_mass), 0.0), xj)
        residual = None
        if want_residual:
            residual = torch.empty_like(nodes.p)
            replay.masses(out=residual)
        return NodeOutput(torch.stack(alphas, -1), None, residual)
