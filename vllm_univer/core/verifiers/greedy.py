"""``greedy``: one-step multi-draft optimal transport (Hu et al., ICLR 2025), scheme ``topk1``.

Node by node. At v with sampled child r and top set T: accept r with prob
min(1, p(r)/q_bar(r)) and descend. Else draw y ~ g, g = p on T and
[p - q_bar]+ off T; y in T descends into that child, otherwise Y = y.

As a DESCENT rule: alpha_r = min(1, p(r)/q_bar(r)); the j-th top child has
alpha = g(u_j) / (G - sum_{i<j} g(u_i)) with G = sum g = P(r rejected), which
makes "first taken child" the categorical draw from g; the stop residual is g off T.
The denominator is summed from what is left, rho + sum_{i>=j} p(u_j) with
rho = sum_{y not in T} [p - q_bar]+ a masked sum, never G minus the parts used.
"""

from __future__ import annotations

import torch

from ..ops import clipped_ratio, gather_tokens, reverse_cumsum
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
        rho = node.residual_mass(nodes, one)  # g's mass off T
        alpha_top = clipped_ratio(node.p_top, rho + reverse_cumsum(node.p_top))
        alpha = torch.cat([alpha_sampled, alpha_top], -1)
        residual = node.residual_rows(nodes, one) if want_residual else None
        return NodeOutput(alpha, None, residual)
