"""``univer``: UniVer, tree verification as conditional optimal transport with
prefix scaling (NeurIPS 2026), scheme ``topk1``.

Allocation (top-down, one level at a time). For node v with prefix scale P~_v,
sampled child r ~ q_bar_v and top children u_1..u_{m-1} (the set T_v):

    P~_r     = min(1, P~_v p_v(r) / q_bar_v(r))
    F_v      = sum_{y not in T} min(q_bar_v(y), P~_v p_v(y))
    R_v(y)   = [P~_v p_v(y) - q_bar_v(y)]+ off T, 0 on T;   rho_v = sum R_v
    P~_{u_j} = P~_v p_v(u_j) / (1 - F_v - sum_{i<j} P~_v p_v(u_i))
    h_v      = rho_v / (rho_v + 1 - P~_v)    (1 if the denominator is 0)

A leaf has h = P~ and R = p (the same formulas with no children).
Decision: the end node is the first node in post-order (sampled child first)
with eta < h; Y ~ R_end.
"""

from __future__ import annotations

import torch

from ..ops import clipped_ratio, continue_prob, exclusive_cumsum, gather_tokens
from .base import Family, NodeBatch, NodeOutput, TreeVerifier
from .topk1 import Topk1Node


class UniVerVerifier(TreeVerifier):
    name = "univer"
    scheme = "topk1"
    family = Family.POSTORDER

    def node_rule(self, nodes: NodeBatch, want_residual: bool) -> NodeOutput:
        node = Topk1Node.read(nodes)
        scale = nodes.scale.unsqueeze(-1)  # [B, n, 1]
        scaled_p = scale * nodes.p
        carried = torch.minimum(node.q_bar, scaled_p).sum(-1, keepdim=True)  # F_v (q_bar is 0 on T)
        residual = (scaled_p - node.q_bar).clamp(min=0).masked_fill(node.in_top, 0)
        stop = continue_prob(residual.sum(-1), nodes.scale)

        scale_sampled = clipped_ratio(gather_tokens(scaled_p, node.sampled), node.q_bar_at_sampled())
        top_mass = gather_tokens(scaled_p, node.top)  # P~ p(u_j), 0 for missing slots
        room = (1.0 - carried - exclusive_cumsum(top_mass)).clamp(min=0)
        scale_top = clipped_ratio(top_mass, room)
        child_scale = torch.cat([scale_sampled, scale_top], -1)
        return NodeOutput(child_scale, stop, residual if want_residual else None)
