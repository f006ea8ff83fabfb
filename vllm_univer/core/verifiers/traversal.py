"""``traversal``: Traversal Verification (Weng et al., NeurIPS 2025), scheme ``wor``.

The algorithm visits leaves of the remaining tree in post-order: a leaf u is
accepted with prob P~[u] (then Y ~ M_b[u]); else it is deleted and its parent a
updates, with x the deleted token:

    S      = sum_y [P~[a] M_b[a](y) - M_s[a](y)]+     (M_s[a] before removing x)
    M_b[a] <- norm([P~[a] M_b[a] - M_s[a]]+)
    M_s[a] <- norm(M_s[a] with x removed)
    P~[a]  <- S / (S + 1 - P~[a])

A deletion changes only the parent's state, and a child's P~ is fixed when the
traversal first enters it, so the whole run is a node rule: the state of v
before slot j gives child j's entry scale min(1, P~ M_b(x_j)/M_s(x_j)), and the
state after all slots gives h_v = P~[v] and the residual M_b[v].
"""

from __future__ import annotations

import torch

from ..ops import clipped_ratio, safe_ratio, stop_prob
from .base import Family, NodeBatch, NodeOutput, TreeVerifier
from .rejection_replay import RejectionReplay


class TraversalVerifier(TreeVerifier):
    name = "traversal"
    scheme = "wor"
    family = Family.POSTORDER

    def node_rule(self, nodes: NodeBatch, want_residual: bool) -> NodeOutput:
        # M_b = T / Mt and M_s = D / Md, unnormalised: deleting x is T <- [P~ T - (Mt / Md) D]+
        # (= Mt [P~ M_b - M_s]+, so S = sum T / Mt) and D(x) <- 0. The rows are
        # distributions, so Mt = Md = 1 before the first deletion; later masses come
        # from a replay, one vocabulary pass per child slot.
        replay = RejectionReplay(nodes.p, nodes.q, removes_tokens=True)
        scale = nodes.scale.unsqueeze(-1)
        t_mass = d_mass = torch.ones_like(scale)
        slots = nodes.tokens.shape[-1]
        residual = torch.empty_like(nodes.p) if want_residual else None
        child_scales = []
        for j in range(slots):  # child slots; nodes stay batched
            xj = nodes.tokens[..., j : j + 1]
            exists = xj >= 0
            t_x, d_x = replay.at(xj)
            t_safe = torch.where(t_mass > 0, t_mass, 1.0)
            child = clipped_ratio(scale * t_x / t_safe, d_x / torch.where(d_mass > 0, d_mass, 1.0))
            child_scales.append((child * exists).squeeze(-1))
            # Delete child j (it was visited and not accepted). S = 0 only when the
            # deletion had probability 0 or P~ = 0 already; M_b is never read then.
            replay.reject(torch.where(exists, scale, 1.0), torch.where(exists, safe_ratio(t_mass, d_mass), 0.0), xj)
            new_t, new_d = replay.masses(out=residual if j == slots - 1 else None)
            new_scale = stop_prob(new_t / t_safe, scale)
            t_mass = torch.where(exists, new_t, t_mass)
            d_mass = torch.where(exists, new_d, d_mass)
            scale = torch.where(exists, new_scale, scale)
        return NodeOutput(torch.stack(child_scales, -1), scale.squeeze(-1), residual)
