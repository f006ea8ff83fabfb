"""Context-aware ``topk1`` trees: each request's tree grown level by level where the
draft is confident, under a node budget (``docs/dynamic-trees.md`` has the rule
and why it is lossless).

At each depth level, every request:

1. ranks its frontier (the drafted nodes of that depth, the root at depth 0) by
   draft path probability, the product of q along the path, and keeps the
   ``expand`` best;
2. gives those nodes child slots: candidate slot j of node v is worth
   score(v) * (the j-th largest entry of q_v), and the level's ``expand * m``
   best candidates (fewer where the node budget runs out; none worth 0) are
   taken, so node v gets k_v of them (``plan_children``);
3. draws the children with the ``topk1`` scheme at k_v: slot 0 from q_v off its
   k_v - 1 top tokens (absent, -1, where they hold all of q_v), slots 1..k_v-1
   those top tokens (``draw_children``).

Steps 1-2 read only what is known before v's children are drawn (the path, the
q rows of the level, draws made at earlier levels), so every node's child slots
are fixed before its children exist, and no drawn child is ever dropped for its
own value: the law the verifier assumes at each node is the law it was drawn
from. Whether a drawn child is expanded later does depend on its value and on its
cousins'; that only shapes its own subtree.

Everything is batched over requests, with fixed shapes per level (``expand``
nodes x ``m`` slots), no host sync and no loop over requests or nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .drafting import top_tokens
from .inverse_cdf import BlockCdf
from .tree import MAX_TREE_NODES
from .tree_batch import TreeBatch


@dataclass(frozen=True)
class DynamicTreeBudget:
    """max_nodes: draft nodes per request (what one target forward verifies);
    max_depth: levels; expand: frontier nodes expanded per level; max_children:
    m, child slots per expanded node."""

    # Defaults: the best of the widths measured at about 30 nodes on the real pair
    # (benchmarks/results/dynamic_trees.md): three nodes x two children per level.
    max_nodes: int = 32
    max_depth: int = 8
    expand: int = 3
    max_children: int = 2

    def __post_init__(self):
        for name in ("max_nodes", "max_depth", "expand", "max_children"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"dynamic tree: {name} must be >= 1, got {getattr(self, name)}")
        if self.max_nodes > MAX_TREE_NODES:
            raise ValueError(f"dynamic tree: max_nodes {self.max_nodes} is above the {MAX_TREE_NODES} supported")

    @property
    def level_width(self) -> int:
        """Child slots one level offers: ``expand * max_children``."""
        return self.expand * self.max_children


def plan_children(
    scores: torch.Tensor, q: torch.Tensor, budget: DynamicTreeBudget, nodes_left: torch.Tensor
) -> torch.Tensor:
    """Child slots of each frontier node of one level, for every request.

    scores: [B, F] draft path probability of each frontier node (0: no node);
    q: [B, F, V] the nodes' draft rows; nodes_left: [B] int64, nodes the budget
    still allows. Returns LongTensor [B, F], k_v (0: not expanded), with at most
    ``expand`` nodes expanded and ``min(expand * m, nodes_left)`` slots in all.
    Ties rank the lower frontier index (then the lower slot) first.
    """
    batch, frontier, vocab = q.shape
    m = min(budget.max_children, vocab)
    # 1. The `expand` best frontier nodes (stable: ties keep the lower index).
    kept = (_descending_rank(scores) < budget.expand) & (scores > 0)
    # 2. The best candidate slots: slot j of v is worth score(v) * (j-th largest q_v).
    top_q = torch.topk(q, m, dim=-1).values  # [B, F, m], descending
    worth = torch.where(kept.unsqueeze(-1), scores.unsqueeze(-1) * top_q, torch.zeros_like(top_q))
    flat = worth.flatten(1)  # [B, F * m]: node-major, so ties go to the lower node, then slot
    flat_rank = _descending_rank(flat)
    slots = torch.clamp(nodes_left, min=0).clamp(max=budget.level_width).unsqueeze(-1)  # [B, 1]
    taken = (flat_rank < slots) & (flat > 0)
    return taken.view(batch, frontier, m).sum(-1)


def _descending_rank(values: torch.Tensor) -> torch.Tensor:
    """[B, K] -> LongTensor [B, K]: each entry's place when its row is sorted in
    descending order, ties kept in index order (0 = the largest)."""
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices
    places = torch.arange(values.shape[-1], device=values.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, places)


def draw_children(
    q: torch.Tensor, num_children: torch.Tensor, max_children: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """``topk1`` children of every frontier node at its own k_v.

    q: [B, F, V]; num_children: [B, F] int64, k_v in 0..max_children. Returns
    LongTensor [B, F, max_children]: slot 0 drawn from q_v off its k_v - 1 top
    tokens, slots 1..k_v-1 those top tokens (rank order, ties to the lower id),
    -1 in slots at or past k_v and in slot 0 where the top tokens hold all of q_v.
    """
    vocab = q.shape[-1]
    m = min(max_children, vocab)
    top = top_tokens(q, m - 1)  # [B, F, m-1]
    slot = torch.arange(1, m, device=q.device)
    top = torch.where(slot < num_children.unsqueeze(-1), top, -1)  # only v's own k_v - 1 top tokens
    sampled = BlockCdf(q).draw(generator, exclude=top)  # -1 where nothing is left
    sampled = torch.where(num_children > 0, sampled, -1)
    kids = torch.cat([sampled.unsqueeze(-1), top], -1)
    if m < max_children:
        kids = torch.cat([kids, kids.new_full(kids.shape[:-1] + (max_children - m,), -1)], -1)
    return kids


def level_sizes(budget: DynamicTreeBudget) -> tuple[int, ...]:
    """Positions per depth 0..D of a budget's trees (``TreeBatch.level_sizes``): the
    root, then per level the slots it may take, ``min(expand, frontier) * m``,
    while the budget lasts. Fixed per budget, so a step's shapes are fixed; each
    level's slot cap is these positions (known before anything is drawn)."""
    sizes, used = [1], 0
    for _ in range(budget.max_depth):
        cap = min(min(budget.expand, sizes[-1]) * budget.max_children, budget.max_nodes - used)
        if cap <= 0:
            break
        sizes.append(cap)
        used += cap
    return tuple(sizes)


def place_children(
    scores: torch.Tensor, num_children: torch.Tensor, kids: torch.Tensor, size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lay one level's children onto the next level's ``size`` positions.

    scores, num_children: [B, F] (as ``plan_children`` saw and returned them); kids:
    [B, F, m] (``draw_children``). The taken slots (slot j of v for j < k_v, absent
    draws included: the position stays, its token is -1) go in order of their
    parent's rank (score, ties to the lower index), then slot. Returns parent
    [B, size] (frontier index, -1: no node) and tokens [B, size] (-1 likewise).
    """
    frontier, m = kids.shape[1], kids.shape[2]
    rank = _descending_rank(scores)
    slot = torch.arange(m, device=kids.device)
    none = frontier * m
    key = torch.where(slot < num_children.unsqueeze(-1), rank.unsqueeze(-1) * m + slot, none).flatten(1)
    picked = torch.sort(key, dim=1, stable=True).indices[:, :size]  # [B, size]: flat (node, slot)
    taken = key.gather(1, picked) < none
    parent = torch.where(taken, picked // m, -1)
    tokens = torch.where(taken, kids.flatten(1).gather(1, picked), -1)
    return parent, tokens


@dataclass
class GrownTrees:
    """A batch of context-aware trees: ``trees`` (TreeBatch), ``tokens`` [B, N+1]
    (-1: no node), ``draft_probs`` [B, N+1, V] (the q rows the children were drawn
    from; zeros at the last level, which has no children)."""

    trees: TreeBatch
    tokens: torch.Tensor
    draft_probs: torch.Tensor


def grow_trees(
    budget: DynamicTreeBudget, draft_rows, batch: int, generator: torch.Generator | None = None
) -> GrownTrees:
    """Grow every request's tree, level by level (the loop a drafter runs).

    draft_rows(paths) -> q [B, F, V]: the draft rows of a level's F positions, from
    their token paths ``paths`` [B, F, d] (-1 somewhere in a path: no node; its
    row is never drawn from). Returns the trees in ``level_sizes(budget)`` layout.
    """
    sizes = level_sizes(budget)
    parents, token_cols, q_cols = [], [], []
    paths = torch.empty(batch, 1, 0, dtype=torch.long)
    scores, offset = None, 0
    for d in range(len(sizes) - 1):
        q = draft_rows(paths)  # [B, F, V]
        paths = paths.to(q.device)
        if scores is None:
            scores = torch.ones(batch, 1, dtype=q.dtype, device=q.device)
            parents.append(torch.full((batch, 1), -1, dtype=torch.long, device=q.device))
            token_cols.append(torch.full((batch, 1), -1, dtype=torch.long, device=q.device))
        q_cols.append(q)
        cap = torch.full((batch,), sizes[d + 1], dtype=torch.long, device=q.device)
        k = plan_children(scores, q, budget, cap)
        kids = draw_children(q, k, budget.max_children, generator)
        parent, tokens = place_children(scores, k, kids, sizes[d + 1])
        parents.append(torch.where(parent >= 0, parent + offset, -1))
        token_cols.append(tokens)
        # The next frontier: each position's path probability (0 where no token) and path.
        safe, vocab = parent.clamp(min=0), q.shape[-1]
        q_of_token = q.flatten(1).gather(1, safe * vocab + tokens.clamp(min=0))
        scores = torch.where(tokens >= 0, scores.gather(1, safe) * q_of_token, 0.0)
        above = paths.gather(1, safe.unsqueeze(-1).expand(-1, -1, paths.shape[-1]))
        paths = torch.cat([above, tokens.unsqueeze(-1)], -1)
        offset += sizes[d]
    q_cols.append(q_cols[-1].new_zeros(batch, sizes[-1], q_cols[-1].shape[-1]))
    trees = TreeBatch(torch.cat(parents, 1), sizes, budget.max_children, validate=False)
    return GrownTrees(trees, torch.cat(token_cols, 1), torch.cat(q_cols, 1))
