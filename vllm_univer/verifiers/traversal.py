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

from ..ops import clipped_ratio, continue_prob, gather_tokens, remove_token_, replace_by_residual_
from .base import Family, NodeBatch, NodeOutput, TreeVerifier


class TraversalVerifier(TreeVerifier):
    name = "traversal"
    scheme = "wor"
    family = Family.POSTORDER

    def node_rule(self, nodes: NodeBatch, want_residual: bool) -> NodeOutput:
        # Working copies updated in place, slot by slot (the inputs stay untouched).
        target, draft, scale = nodes.p.clone(), nodes.q.clone(), nodes.scale.unsqueeze(-1)
        work = torch.empty_like(target)
        child_scales = []
        for j in range(nodes.tokens.shape[-1]):  # child slots; nodes stay batched
            xj = nodes.tokens[..., j:j + 1]
            exists = xj >= 0
            child = clipped_ratio(scale * gather_tokens(target, xj), gather_tokens(draft, xj))
            child_scales.append((child * exists).squeeze(-1))
            # Delete child j (it was visited and not accepted).
            # mass = 0 only when the deletion had probability 0 or P~ = 0 already.
            mass = replace_by_residual_(target, draft, scale, exists, work)
            new_scale = continue_prob(mass, scale)
            remove_token_(draft, xj, exists)
            scale = torch.where(exists, new_scale, scale)
        return NodeOutput(
            torch.stack(child_scales, -1),
            scale.squeeze(-1),
            target if want_residual else None,
        )
