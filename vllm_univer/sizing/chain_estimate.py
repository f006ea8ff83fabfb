"""What the chain would have accepted, read off a wider tree that was verified instead.

``tree: auto`` chooses between the configured tree and its chain (its width
cut 1). While the tree is chosen, the chain is drafted only on exploration,
so its acceptance would stay a guess; yet every verified tree holds the
chain's evidence: its children are drawn from the same draft rows q a chain
would be drawn from, and the target rows p of every node are at hand.

The estimate is of P(A >= j), j = 1 .. D, A the depth accepted by
*token-level* verification of a chain drafted from the same rows. On a chain
the tree verifiers reduce to block verification, which accepts at least as
much (measured on the real pair: +0.3 % tau at T = 1, +2 % at T = 0.3), so
the estimate errs slightly low.

Sampled rows. A chain's child of node v is x ~ q_v, accepted with probability
min(1, p_v(x) / q_v(x)). Each child slot of v gets a weight whose expectation
over v's children draw, times whatever depends on the child's token and its
subtree, equals the chain's:

* ``chain`` / ``iid`` / ``wor``: slot 0 is itself a draw from q_v: weight
  min(1, p_v(x) / q_v(x)) there, 0 on the other slots;
* ``topk1``: slots 1 .. m-1 hold the top tokens T_v, slot 0 a draw r from q_v
  off T_v; a chain draw is t in T_v with probability q_v(t), else distributed
  as r: weight min(p_v(t), q_v(t)) on top slot t, and
  (1 - q_v(T_v)) min(1, p_v(r) / q_v(r)) on slot 0.

Every subtree is drawn from its own node's rows, whatever its siblings are, so
the sum over depth-j nodes of the product of weights along their paths,
S_j, is unbiased for P(A >= j) (``tests/sizing/test_chain_estimate.py`` checks the
expectation exactly over every tree).

Greedy rows draft the top tokens in rank order in every scheme, so the chain
is the slot-0 path, accepted while each of its tokens is the target's argmax:
S_j = 1 iff the tree's accepted path took slot 0 for its first j steps (exact).
"""

from __future__ import annotations

import torch

from ..core.tree import TreeSpec


def chain_survival(tree: TreeSpec, scheme: str, tokens: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Sampled rows: tokens LongTensor [B, N+1] (-1: no node), p and q [B, N+1, V]
    the target and draft rows at every node -> [B, D] S_j, unbiased estimates of
    P(A >= j) for a chain drafted from q and verified token by token against p.
    One gather of p and q at the drafted tokens: no pass over the vocabulary."""
    tt = tree.on(tokens.device)
    batch = tokens.shape[0]
    drafted = tokens[:, 1:]
    exists = drafted >= 0
    parent = tt.parent[1:]
    at = (torch.arange(batch, device=tokens.device).unsqueeze(1), parent, drafted.clamp(min=0))
    p_x, q_x = p[at], q[at]  # [B, N]: p_parent(x), q_parent(x)
    both = torch.minimum(p_x, q_x)
    accept = both / q_x.clamp(min=torch.finfo(q_x.dtype).tiny)  # min(1, p/q); q > 0 where x was drawn
    first_slot = tt.slot[1:] == 0
    if scheme == "topk1":
        top = exists & ~first_slot
        top_mass = p_x.new_zeros(batch, tree.num_nodes + 1)
        top_mass.index_add_(1, parent, q_x.masked_fill(~top, 0.0))
        residual = (1.0 - top_mass[:, parent]).clamp(min=0.0) * accept
        weight = torch.where(first_slot, residual, both)
    else:
        weight = accept.masked_fill(~first_slot, 0.0)
    weight = weight.masked_fill(~exists, 0.0)
    ones = torch.ones_like(weight[:, :1])
    # Product of the weights along each node's path (index N+1 and the root: 1).
    reach = torch.cat([ones, weight, ones], 1)[:, tt.path_nodes].prod(-1)  # [B, N+1]
    return _per_depth(tt, reach)


def greedy_chain_survival(tree: TreeSpec, accepted_path: torch.Tensor) -> torch.Tensor:
    """Greedy rows: accepted_path LongTensor [B, D'] (the accepted nodes at depth
    1 .. D', -1 past the end; D' >= the tree's depth) -> [B, D] float32, 1.0 where
    the chain (the slot-0 path) is accepted through depth j."""
    tt = tree.on(accepted_path.device)
    path = accepted_path[:, : tree.max_depth]
    on_chain = (path >= 0) & (tt.slot[path.clamp(min=0)] == 0)
    return on_chain.to(torch.float32).cumprod(1)


def _per_depth(tt, reach: torch.Tensor) -> torch.Tensor:
    """[B, N+1] per node -> [B, D] summed over the nodes of each depth 1 .. D."""
    out = torch.zeros(reach.shape[0], tt.max_depth + 1, dtype=reach.dtype, device=reach.device)
    return out.index_add_(1, tt.depth, reach)[:, 1:]
