"""``block``: Block Verification (Sun et al. 2024), scheme ``chain``.

Path x_1..x_g. P~_0 = 1; P~_i = min(1, P~_{i-1} p(x_i)/q(x_i)).
For i < g: S_i = sum_y [P~_i p_i(y) - q_i(y)]+, h_i = S_i / (S_i + 1 - P~_i);
h_g = P~_g. The step ends at the deepest i with eta_i < h_i (post-order on a
chain), and Y ~ [P~_i p_i - q_i]+ (Y ~ p_g at the leaf).
"""

from __future__ import annotations

from ..ops import clipped_ratio, gather_tokens, stop_prob
from .base import Family, NodeBatch, NodeOutput, TreeVerifier


class BlockVerifier(TreeVerifier):
    name = "block"
    scheme = "chain"
    family = Family.POSTORDER
    chain_only = True

    def node_rule(self, nodes: NodeBatch, want_residual: bool) -> NodeOutput:
        x = nodes.tokens[..., :1]  # [B, n, 1]
        scale = nodes.scale.unsqueeze(-1)
        child_scale = clipped_ratio(scale * gather_tokens(nodes.p, x), gather_tokens(nodes.q, x))
        child_scale = child_scale * (x >= 0)
        # At a leaf q plays no part: the residual is P~ p, so h = P~.
        q = nodes.q * (x >= 0).to(nodes.q.dtype)
        residual = (scale * nodes.p - q).clamp(min=0)
        stop = stop_prob(residual.sum(-1), nodes.scale)
        return NodeOutput(child_scale, stop, residual if want_residual else None)
