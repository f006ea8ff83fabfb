"""The interface every tree verifier implements.

Every verifier of this package is described by a *node rule*: a function of one
node's target row p, draft row q, child tokens and (for some methods) the prefix
scale P~ of the node, that says

* how likely each child is to be taken (``child_weights``), and
* what the extra token Y is drawn from if the step ends at this node
  (``residual``, unnormalised).

Two families turn those numbers into the end node e:

``DESCENT`` (token, rrs, rrsw, greedy, target_only)
    Walk down from the root. At node v try the children in slot order; child c
    is taken with conditional probability ``alpha_c`` (given that every earlier
    sibling was not), and the walk continues in c. If no child is taken, e = v.

``POSTORDER`` (block, traversal, univer)
    ``child_weights`` gives each child's prefix scale P~ (entry value), and the
    rule also returns ``h_v`` for the node itself (for a leaf h = P~). Draw
    eta_u ~ U(0,1) per node; e is the first node in post-order with eta_e < h_e.

A node rule depends only on its own rows and P~, never on its subtree, so the
whole tree is processed one depth level at a time, every node of a level and
every request of the batch at once.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class Family(enum.Enum):
    DESCENT = "descent"
    POSTORDER = "postorder"


@dataclass
class NodeBatch:
    """Inputs of a node rule for n nodes of each of B requests.

    p:      [B, n, V]  target rows p_v
    q:      [B, n, V]  draft rows q_v (what v's children were drawn from)
    tokens: [B, n, C]  child tokens in slot order, -1 where a child does not exist
    scale:  [B, n]     prefix scale P~_v (POSTORDER rules; ones for DESCENT rules)
    kid_sizes: [n, C] or [B, n, C]  nodes in each child slot's subtree, 0 where the
            slot does not exist (the tree's shape, the same for every request)
    even_pairs: whether slots 2j and 2j+1 carry subtrees of equal size wherever both
            exist (host-known from the shape; TreeSpec.even_pairs)
    """

    p: torch.Tensor
    q: torch.Tensor
    tokens: torch.Tensor
    scale: torch.Tensor
    kid_sizes: torch.Tensor | None = None
    even_pairs: bool = False

    @property
    def vocab_size(self) -> int:
        return self.p.shape[-1]


@dataclass
class NodeOutput:
    """child_weights [B, n, C] (alpha for DESCENT, P~ of the child for POSTORDER; 0 for
    missing children), stop_prob [B, n] (h_v, POSTORDER only), residual [B, n, V]
    (unnormalised law of Y if the step ends at v; None unless asked for)."""

    child_weights: torch.Tensor
    stop_prob: torch.Tensor | None
    residual: torch.Tensor | None


class TreeVerifier:
    """A lossless tree verifier: its name, its draft scheme and its node rule."""

    name: str
    scheme: str
    family: Family
    chain_only: bool = False
    # Whether node_rule reads NodeBatch.kid_sizes (else None is passed: no work for it).
    uses_kid_sizes: bool = False

    def node_rule(self, nodes: NodeBatch, want_residual: bool) -> NodeOutput:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(scheme={self.scheme!r})"
