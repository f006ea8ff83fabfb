"""``target_only``: draft probabilities ignored (EAGLE / SGLang tree sampling), any scheme.

At v: p' = p_v. For each child x in slot order with p'(x) > 0: accept with
prob p'(x) and descend; else p'(x) <- 0, p' <- norm(p'). All rejected: Y ~ p'.

Closed form: after rejecting children x_1..x_{j-1}, p' = p off those tokens,
renormalised, so alpha_j = p(x_j) / (1 - sum of p over the distinct earlier
tokens), and 0 for a token that repeats an earlier one (its p' is 0). The stop
residual is p with every child token removed. The denominator is summed from what
is left (p off every child token, a masked sum, plus the later children's p), never
1 minus what was used, which cancels when the target is nearly sure.
"""

from __future__ import annotations

import torch

from ..ops import clipped_ratio, gather_tokens, mass_off, reverse_cumsum, token_set_mask
from .base import Family, NodeBatch, NodeOutput, TreeVerifier


class TargetOnlyVerifier(TreeVerifier):
    name = "target_only"
    # Lossless for any scheme. The engine drafts it like EAGLE trees (the top
    # tokens) plus one sampled child: the same `topk1` trees as greedy and univer.
    scheme = "topk1"
    family = Family.DESCENT

    def node_rule(self, nodes: NodeBatch, want_residual: bool) -> NodeOutput:
        tokens = nodes.tokens  # [B, n, C]
        slots = tokens.shape[-1]
        earlier = torch.ones(slots, slots, dtype=torch.bool, device=tokens.device).tril(-1)
        repeats = ((tokens.unsqueeze(-1) == tokens.unsqueeze(-2)) & earlier).any(-1)  # same token in an earlier slot
        first = (tokens >= 0) & ~repeats
        mass = gather_tokens(nodes.p, tokens) * first
        alpha = clipped_ratio(mass, mass_off(nodes.p, tokens) + reverse_cumsum(mass))
        residual = None
        if want_residual:
            residual = nodes.p.masked_fill(token_set_mask(tokens, nodes.vocab_size), 0)
        return NodeOutput(alpha, None, residual)
