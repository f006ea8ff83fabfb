"""Run a verifier's node rule over whole trees and turn it into an end node.

``node_weights``      top-down pass, one depth level at a time: per-node weights
                  (alpha or entry P~) and, for POSTORDER rules, stop probs h.
``decide_*``      the end node from per-node uniforms (verify).
``end_node_law``  the exact P(end node = e) (outcome_law).
``node_residuals`` the residual rows of chosen nodes (or of every node).
"""

from __future__ import annotations

import torch

from .tree import _TreeTensors
from .verifiers import Family, NodeBatch, TreeVerifier


def child_tokens(tt: _TreeTensors, tokens: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
    """tokens [B, N+1], nodes [n] or [B, n] -> [B, n, C]: the child tokens of each node, -1 padded."""
    kids = tt.children_of(nodes)  # [n, C] or [B, n, C]
    if kids.dim() == 2:
        kids = kids.unsqueeze(0).expand(tokens.shape[0], -1, -1)
    picked = tokens.gather(1, kids.clamp(min=0).flatten(1)).view_as(kids)
    return picked.masked_fill(kids < 0, -1)


def node_batch(
    verifier: TreeVerifier, tt: _TreeTensors, p, q, tokens, nodes: torch.Tensor, scale: torch.Tensor
) -> NodeBatch:
    """The NodeBatch of ``nodes`` [n] or [B, n] (p, q [B, n, V], scale [B, n]); the child
    subtree sizes only for the verifiers that read them (``uses_kid_sizes``)."""
    sizes = tt.kid_sizes[nodes] if verifier.uses_kid_sizes else None
    return NodeBatch(p, q, child_tokens(tt, tokens, nodes), scale, sizes, tt.even_pairs)


def node_weights(
    verifier: TreeVerifier,
    tt: _TreeTensors,
    tokens: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    node_rule=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-node weights of a batch of trees.

    Args:
        tokens: LongTensor [B, N+1] (-1: missing node); target_probs, draft_probs [B, N+1, V].
        node_rule: the verifier's rule in another form (``compiled_rules``); default its own.

    Returns:
        weight [B, N+1]: alpha_c (DESCENT) or the entry scale P~_c (POSTORDER); 1 at the root.
        stop [B, N+1] (POSTORDER only): h_v; 0 for missing nodes, 1 at the root.
    """
    batch, n1, _ = target_probs.shape
    postorder = verifier.family is Family.POSTORDER
    weight = target_probs.new_zeros(batch, n1)
    weight[:, 0] = 1.0
    stop = target_probs.new_zeros(batch, n1) if postorder else None
    for level in tt.levels:  # depth by depth: a level's scales need its parents'
        nodes = level.nodes
        scale = level.rows(weight) if postorder else torch.ones_like(level.rows(weight))
        batch = node_batch(verifier, tt, level.rows(target_probs), level.rows(draft_probs), tokens, nodes, scale)
        kid_tokens = batch.tokens
        out = (node_rule or verifier.node_rule)(batch, want_residual=False)
        # A mask, not a product: rows of missing nodes are never read, even if they hold NaN.
        child_w = out.child_weights.masked_fill(kid_tokens < 0, 0.0)
        level.put_kids(weight, child_w)
        if postorder:
            level.put(stop, out.stop_prob)
    return weight, finish_stop(tt, tokens, weight, stop) if postorder else None


def finish_stop(tt: _TreeTensors, tokens: torch.Tensor, weight: torch.Tensor, stop: torch.Tensor) -> torch.Tensor:
    """POSTORDER stop probabilities of every node from those of the internal nodes
    [B, N+1]: a leaf stops with its entry scale, a missing node never, the root always."""
    stop = torch.where(tt.is_internal, stop, weight)
    stop = stop.masked_fill(tokens < 0, 0.0)
    stop[:, 0].fill_(1.0)  # the root always qualifies once reached (a fill: no scalar tensor copied in)
    return stop


def decide_postorder(tt: _TreeTensors, stop: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """End node = the first node in post-order with eta < h. stop, uniforms [B, N+1] -> [B]."""
    hit = uniforms < stop
    hit[:, 0].fill_(True)
    never = tt.postorder_rank.numel()
    rank = torch.where(hit, tt.postorder_rank.expand_as(hit), torch.full_like(hit, never, dtype=torch.long))
    return rank.argmin(-1)


def decide_descent(tt: _TreeTensors, alpha: torch.Tensor, uniforms: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Walk down: at each node take the first child (slot order) with eta < alpha; stop when none.

    alpha, uniforms [B, N+1] -> end node [B]. One step per depth level, no host sync.
    """
    node = torch.zeros(alpha.shape[0], dtype=torch.long, device=alpha.device)
    for _ in range(max_depth):
        kids = tt.children_of(node)  # [B, C]
        safe = kids.clamp(min=0)
        take = (uniforms.gather(1, safe) < alpha.gather(1, safe)) & (kids >= 0)
        first = take.to(torch.uint8).argmax(-1, keepdim=True)
        node = torch.where(take.any(-1), kids.gather(1, first).squeeze(-1), node)
    return node


def end_node_law(
    verifier: TreeVerifier, tt: _TreeTensors, weight: torch.Tensor, stop: torch.Tensor | None
) -> torch.Tensor:
    """Exact P(end node = e) [B, N+1] from the per-node weights of ``node_weights``."""
    if verifier.family is Family.POSTORDER:
        order = tt.postorder.expand_as(stop)
        h = stop.gather(1, order)
        survive = torch.cumprod(1.0 - h, -1)
        before = torch.cat([torch.ones_like(survive[:, :1]), survive[:, :-1]], -1)
        return torch.empty_like(h).scatter_(1, order, h * before)

    reach = torch.zeros_like(weight)
    reach[:, 0] = 1.0
    law = torch.zeros_like(weight)
    for level in tt.levels:
        alpha = level.take_kids(weight)  # 0 at empty slots
        keep = torch.cumprod(1.0 - alpha, -1)  # no child among slots 0..j taken
        before = torch.cat([torch.ones_like(keep[..., :1]), keep[..., :-1]], -1)
        parent_reach = level.rows(reach).unsqueeze(-1)
        level.put_kids(reach, parent_reach * before * alpha)
        level.put(law, parent_reach.squeeze(-1) * keep[..., -1])
    return torch.where(tt.is_internal, law, reach)


def node_residuals(
    verifier: TreeVerifier,
    tt: _TreeTensors,
    tokens: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    weight: torch.Tensor,
    nodes: torch.Tensor,
    node_rule=None,
) -> torch.Tensor:
    """Unnormalised law of Y at the given nodes.

    nodes: LongTensor [B, n] (per request) -> residual [B, n, V]. Only these n rows
    per request are gathered, so verify never builds a [B, N+1, V] temporary.
    node_rule: as in ``node_weights``.
    """
    vocab = target_probs.shape[-1]
    rows = nodes.unsqueeze(-1).expand(-1, -1, vocab)
    p = target_probs.gather(1, rows)
    q = draft_probs.gather(1, rows)
    scale = weight.gather(1, nodes) if verifier.family is Family.POSTORDER else torch.ones_like(weight.gather(1, nodes))
    rule = node_rule or verifier.node_rule
    out = rule(node_batch(verifier, tt, p, q, tokens, nodes, scale), want_residual=True)
    return out.residual
