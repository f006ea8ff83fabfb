"""``greedy``: one-step multi-draft optimal transport (Hu et al., ICLR 2025), scheme ``topk1``.

Node by node. At v with sampled child r and top set T: accept r with prob
min(1, p(r)/q_bar(r)) and descend. Else draw y ~ g, g = p on T and
[p - q_bar]+ off T; y in T descends into that child, otherwise Y = y.

As a DESCENT rule: alpha_r = min(1, p(r)/q_bar(r)); the j-th top child has
alpha = g(u_j) / (G - sum_{i<j} g(u_i)) with G = sum g = P(r rejected), which
makes "first taken child" the categorical draw from g; the stop residual is g off T.
"""

from __future__ import annotations

import torch

from ..ops import clipped_ratio, exclusive_cumsum, gather_tokens
from .base import Family, NodeBatch, NodeOutput, TreeVerifier
from .topk1 import Topk1Node


class GreedyOTVerifier(TreeVerifier):
    name = "greedy"
    scheme = "topk1"
    family = Family.DESCENT

    def node_rule(self, nodes: NodeBatch, want_residual: bool) -> NodeOutput:
        node = Topk1Node.read(nodes)
        one = torch.ones_like(node.q_off_top)
        alpha_sampled = clipped_ratio(gather_tokens(nodes.p, node.sampled), node.q_bar_at(nodes, node.sampled))
        # G = sum_T p + sum_{off T} [p - q_bar]+ = sum p - sum_{off T} min(p, q_bar)
        g_total = nodes.p.sum(-1, keepdim=True) - node.carried_mass(nodes, one)
        g_top = node.p_top
        alpha_top = clipped_ratio(g_top, (g_total - exclusive_cumsum(g_top)).clamp(min=0))
        alpha = torch.cat([alpha_sampled, alpha_top], -1)
        residual = node.residual_rows(nodes, one) if want_residual else None
        return NodeOutput(alpha, None, residual)
