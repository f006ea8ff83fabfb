"""``token``: token-level chain verification (Leviathan et al.; Chen et al.), scheme ``chain``.

Walk down the chain: accept x with prob min(1, p(x)/q(x)); at the first
rejection at v, Y ~ [p_v - q_v]+.
"""

from __future__ import annotations

from ..ops import clipped_ratio, gather_tokens
from .base import Family, NodeBatch, NodeOutput, TreeVerifier


class TokenVerifier(TreeVerifier):
    name = "token"
    scheme = "chain"
    family = Family.DESCENT
    chain_only = True

    def node_rule(self, nodes: NodeBatch, want_residual: bool) -> NodeOutput:
        x = nodes.tokens[..., :1]  # [B, n, 1]
        alpha = clipped_ratio(gather_tokens(nodes.p, x), gather_tokens(nodes.q, x))
        residual = None
        if want_residual:
            # A node with no (existing) child is a leaf: Y ~ p.
            has_child = (x >= 0).to(nodes.q.dtype)
            residual = (nodes.p - has_child * nodes.q).clamp(min=0)
        return NodeOutput(alpha, None, residual)
