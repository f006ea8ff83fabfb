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

Every mass is a masked sum (no cancellation when the draft or the target is
nearly sure): rho_v is one pass over the vocabulary off T of its own terms
(``Topk1Node.residual_mass``), and the room left for u_j is the sum of what
is left, not 1 minus what is used: since p_v sums to 1 and
sum_{y not in T} (min(q_bar, P~ p) + [P~ p - q_bar]+) = P~ p_v(off T),

    1 - F_v - sum_{i<j} P~_v p_v(u_i) = (1 - P~_v) + rho_v + sum_{i>=j} P~_v p_v(u_i).
"""

from __future__ import annotations

import torch

from ..ops import clipped_ratio, gather_tokens, reverse_cumsum, stop_prob
from .base import Family, NodeBatch, NodeOutput, TreeVerifier
from .topk1 import Topk1Node


class UniVerVerifier(TreeVerifier):
    name = "univer"
    scheme = "topk1"
    family = Family.POSTORDER

    def node_rule(self, nodes: NodeBatch, want_residual: bool) -> NodeOutput:
        node = Topk1Node.read(nodes)
        scale = nodes.scale.unsqueeze(-1)  # [B, n, 1]
        rho = node.residual_mass(nodes, scale)  # rho_v (F_v enters through room)
        top_mass = scale * node.p_top  # P~ p(u_j), 0 for missing slots
        stop = stop_prob(rho, scale).squeeze(-1)

        scale_sampled = clipped_ratio(scale * gather_tokens(nodes.p, node.sampled), node.q_bar_at(nodes, node.sampled))
        room = (1.0 - scale) + rho + reverse_cumsum(top_mass)
        child_scale = torch.cat([scale_sampled, clipped_ratio(top_mass, room)], -1)
        residual = node.residual_rows(nodes, scale) if want_residual else None
        return NodeOutput(child_scale, stop, residual)
