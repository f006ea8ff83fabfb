"""``target_only``: draft probabilities ignored (EAGLE / SGLang tree sampling), any scheme.

At v: p' = p_v. For each child x in slot order with p'(x) > 0: accept with
prob p'(x) and descend; else p'(x) <- 0, p' <- norm(p'). All rejected: Y ~ p'.
"""

from __future__ import annotations

import torch

from ..ops import gather_tokens, normalize, one_token_mask
from .base import Family, NodeBatch, NodeOutput, TreeVerifier


class TargetOnlyVerifier(TreeVerifier):
    name = "target_only"
    # Lossless for any scheme. The engine drafts it like EAGLE trees (the top
    # tokens) plus one sampled child: the same `topk1` trees as greedy and univer.
    scheme = "topk1"
    family = Family.DESCENT

    def node_rule(self, nodes: NodeBatch, want_residual: bool) -> NodeOutput:
        p = nodes.p
        alphas = []
        for j in range(nodes.tokens.shape[-1]):
            x = nodes.tokens[..., j]
            alphas.append(gather_tokens(p, x.unsqueeze(-1)).squeeze(-1).clamp(max=1.0))
            # After rejecting x, p' loses x. If x held all of p' it was accepted surely.
            new_p, mass = normalize(p.masked_fill(one_token_mask(x, nodes.vocab_size), 0))
            p = torch.where(((x >= 0) & (mass > 0)).unsqueeze(-1), new_p, p)
        return NodeOutput(torch.stack(alphas, -1), None, p if want_residual else None)
