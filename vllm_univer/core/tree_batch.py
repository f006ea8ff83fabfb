"""Per-request tree shapes in one batch: what context-aware trees need
(``dynamic_tree``, ``docs/dynamic-trees.md``).

A ``TreeSpec`` is one shape shared by the batch. A ``TreeBatch`` keeps what can
stay shared, the *levels*: positions 0..N numbered depth by depth with a fixed
number of positions per depth (the root alone at depth 0), so every request
still has N+1 rows and every depth a fixed span. What each request owns is the
parent of each position (one of the previous depth's positions, or -1 where
the position holds no node). The children of one parent are ordered by
position: the first is slot 0.

The verifiers' passes (``tree_pass``, ``api``) read a TreeBatch through the same
methods as a TreeSpec's tables (``_TreeTensors``): gathers by per-request index
where a shared shape indexes by constant. So univer, greedy and target_only, whose
node rules read only a node's rows and its children's tokens, run on it
unchanged. The rules that weigh children by their subtree sizes (univer_wor) or
need the fused kernels' fixed tables do not (``TREE_BATCH_METHODS``).

Every table is built on the parents' device by batched tensor code: loops over
depth levels, no loop over requests or nodes, no host sync (except in
``validate``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from .tree import MAX_TREE_NODES, TreeSpec

TREE_BATCH_METHODS = ("univer", "greedy", "target_only")


@dataclass(frozen=True)
class LevelLayout:
    """The levels a batch of per-request trees shares: positions per depth 0..D
    (``level_sizes[0] = 1``, the root) and C, the most children of one node. What
    a step's positions, slots and level spans are built from; the parents are
    each request's own (``TreeBatch``)."""

    level_sizes: tuple[int, ...]
    max_children: int

    is_chain = False

    def __post_init__(self):
        sizes = tuple(int(n) for n in self.level_sizes)
        object.__setattr__(self, "level_sizes", sizes)
        if not sizes or sizes[0] != 1 or min(sizes) < 1:
            raise ValueError(f"tree levels: level sizes must start with 1 (the root) and be >= 1, got {sizes}")
        if len(sizes) < 2:
            raise ValueError("tree levels: at least one level of draft positions is needed")
        if self.num_nodes > MAX_TREE_NODES:
            raise ValueError(f"tree levels have {self.num_nodes} positions; at most {MAX_TREE_NODES} are supported")
        if self.max_children < 1:
            raise ValueError(f"tree levels: max_children must be >= 1, got {self.max_children}")

    @property
    def num_nodes(self) -> int:
        return sum(self.level_sizes) - 1

    @property
    def max_depth(self) -> int:
        return len(self.level_sizes) - 1

    @property
    def nodes_per_depth(self) -> list[int]:
        return list(self.level_sizes)

    @cached_property
    def depth(self) -> torch.Tensor:
        """LongTensor [N+1] (CPU): each position's depth."""
        return torch.repeat_interleave(torch.arange(len(self.level_sizes)), torch.tensor(self.level_sizes))

    def depth_on(self, device: torch.device) -> torch.Tensor:
        """``depth`` on ``device``, copied there once per layout (a tree batch built
        inside a captured region must not copy from the host)."""
        if device not in self._depths:
            self._depths[device] = self.depth.to(device)
        return self._depths[device]

    @cached_property
    def _depths(self) -> dict[torch.device, torch.Tensor]:
        return {}

    @cached_property
    def spans(self) -> tuple[slice, ...]:
        """Per depth 0..D: the slice of its positions."""
        starts = list(itertools.accumulate(self.level_sizes, initial=0))
        return tuple(slice(starts[d], starts[d + 1]) for d in range(len(self.level_sizes)))

    def cut(self, depth: int) -> LevelLayout:
        """The levels down to ``depth`` (a breadth-first prefix of the positions)."""
        return LevelLayout(self.level_sizes[: depth + 1], self.max_children)

    @cached_property
    def static_tree(self) -> TreeSpec:
        """One fixed tree on these levels: each level's first nodes take C children
        each, in order, as many as the next level has positions (the last of them
        fewer where they do not divide). Its positions are the levels' (node i at
        position i). What a step drafts when something outside the workers must know
        the shape before the drafts exist: vLLM's scheduler builds a structured-output
        request's grammar rows from its draft tokens and one shape
        (``UniverConfig.grammar_tree``)."""
        paths, level = [], [()]
        for size in self.level_sizes[1:]:
            if size > len(level) * self.max_children:
                raise ValueError(f"tree levels {self.level_sizes}: {size} positions below {len(level)} nodes")
            level = [(*level[i // self.max_children], i % self.max_children) for i in range(size)]
            paths += level
        return TreeSpec([(), *paths])


class TreeBatch:
    """Shapes of B trees over shared levels.

    parent: LongTensor [B, N+1]; parent[:, 0] = -1 (the root); a position of depth
    d >= 1 has its parent among the positions of depth d-1, or -1 (no node).
    level_sizes: positions per depth 0..D (level_sizes[0] = 1, the root), or their
    ``LevelLayout``.
    max_children: C, the most children any node may have (the child tables' width).
    """

    def __init__(
        self, parent: torch.Tensor, level_sizes: Sequence[int] | LevelLayout, max_children: int, validate: bool = True
    ):
        # (A layout given as such is reused: its depth is on the device already.)
        layout = level_sizes if isinstance(level_sizes, LevelLayout) else None
        self.layout = layout or LevelLayout(tuple(level_sizes), int(max_children))  # checks the levels
        if self.layout.max_children != max_children:
            raise ValueError(f"max_children {max_children} differs from the layout's {self.layout.max_children}")
        self.level_sizes, self.max_children = self.layout.level_sizes, self.layout.max_children
        self.num_nodes, self.max_depth, self.spans = self.layout.num_nodes, self.layout.max_depth, self.layout.spans
        if parent.dim() != 2 or parent.shape[1] != self.num_nodes + 1:
            raise ValueError(f"parent must be [B, N+1] = [B, {self.num_nodes + 1}], got {tuple(parent.shape)}")
        self.parent = parent.long()
        self.depth = self.layout.depth_on(parent.device)
        if validate:
            self.validate()
        self.slot = self._slots()
        self.children = self._children()
        self.is_internal = self.children[..., 0] >= 0
        self.ancestors = self._ancestors()
        self.even_pairs = False  # read by univer_wor only, which does not run here

    @property
    def batch_size(self) -> int:
        return self.parent.shape[0]

    def on(self, device: torch.device | str) -> TreeBatch:
        if torch.device(device) != self.parent.device:
            raise ValueError(f"tree batch is on {self.parent.device}, the rows on {device}")
        return self

    def validate(self) -> None:
        """Raise ValueError unless each position's parent lies in the previous depth
        (or is -1), parents hold nodes, and no node has more than C children."""
        parent = self.parent
        bad_root = (parent[:, 0] != -1).any()
        bad_range = torch.zeros((), dtype=torch.bool, device=parent.device)
        orphan = torch.zeros_like(bad_range)
        count = torch.zeros_like(parent)
        for d in range(1, len(self.level_sizes)):
            above, here = self.spans[d - 1], self.spans[d]
            par = parent[:, here]
            inside = (par >= above.start) & (par < above.stop)
            bad_range |= ((par != -1) & ~inside).any()
            if d >= 2:  # a parent that is itself no node
                orphan |= (inside & (parent.gather(1, par.clamp(min=0)) < 0)).any()
            count.scatter_add_(1, par.clamp(min=0), inside.long())
        too_many = (count > self.max_children).any()
        flags = torch.stack([bad_root, bad_range, orphan, too_many]).tolist()
        if flags[0]:
            raise ValueError("malformed tree batch: position 0 is the root (parent -1)")
        if flags[1]:
            raise ValueError("malformed tree batch: a position's parent is not in the depth above it (or -1)")
        if flags[2]:
            raise ValueError("malformed tree batch: a position's parent holds no node")
        if flags[3]:
            raise ValueError(f"malformed tree batch: a node has more than max_children = {self.max_children} children")

    # ------------------------------------------------------------ the tables
    def _slots(self) -> torch.Tensor:
        """[B, N+1]: each node's rank among its parent's children by position; -1 at
        the root and at empty positions."""
        slot = torch.full_like(self.parent, -1)
        for span in self.spans[1:]:
            par = self.parent[:, span]  # [B, n]
            same = (par.unsqueeze(-1) == par.unsqueeze(-2)) & (par >= 0).unsqueeze(-1)
            n = par.shape[1]
            earlier = torch.ones(n, n, dtype=torch.bool, device=par.device).tril(-1)
            rank = (same & earlier).sum(-1)
            slot[:, span] = torch.where(par >= 0, rank, -1)
        return slot

    def _children(self) -> torch.Tensor:
        """[B, N+1, C]: each node's children in slot order, -1 padded."""
        batch, n1, c = self.batch_size, self.num_nodes + 1, self.max_children
        flat = torch.full((batch, n1 * c + 1), -1, dtype=torch.long, device=self.parent.device)
        index = torch.where(self.parent >= 0, self.parent * c + self.slot, n1 * c)  # empty: a spare column
        positions = torch.arange(n1, device=self.parent.device).expand(batch, -1)
        flat.scatter_(1, index, positions)
        return flat[:, :-1].view(batch, n1, c)

    def _ancestors(self) -> torch.Tensor:
        """[B, N+1, D]: the nodes at depth 1..D on the path to each node (-1 past it).
        ups[j] = the j-th ancestor of every position; column k of a node of depth d
        is its (d-1-k)-th ancestor."""
        up = torch.arange(self.num_nodes + 1, device=self.parent.device).expand(self.batch_size, -1)
        ups = [up]
        for _ in range(self.max_depth - 1):
            up = torch.where(up > 0, self.parent.gather(1, up.clamp(min=0)), -1)
            ups.append(up)
        stacked = torch.stack(ups, -1)  # [B, N+1, D]
        steps = self.depth.unsqueeze(-1) - 1 - torch.arange(self.max_depth, device=self.parent.device)
        picked = stacked.gather(2, steps.clamp(min=0).expand(self.batch_size, -1, -1))
        return torch.where(steps >= 0, picked, -1)

    @cached_property
    def ancestor_mask(self) -> torch.Tensor:
        """BoolTensor [B, N+1, N+1]: mask[b, i, j] = j is i or an ancestor of i (the
        root is every node's ancestor; a position without a node sees itself only)."""
        n1 = self.num_nodes + 1
        mask = torch.zeros(self.batch_size, n1, n1 + 1, dtype=torch.bool, device=self.parent.device)
        mask[:, :, 0] = True
        mask.scatter_(2, torch.where(self.ancestors >= 0, self.ancestors, n1), True)
        mask[:, :, n1] = False
        mask = mask[:, :, :n1]
        empty = (self.parent < 0) & (torch.arange(n1, device=self.parent.device) > 0)
        return mask & ~(empty.unsqueeze(-1) & ~torch.eye(n1, dtype=torch.bool, device=mask.device))

    def take(self, start: int, stop: int) -> TreeBatch:
        """Requests ``start`` .. ``stop`` - 1 (e.g. one seeded request verified alone)."""
        return TreeBatch(self.parent[start:stop], self.level_sizes, self.max_children, validate=False)

    def cut(self, depth: int) -> TreeBatch:
        """The trees down to ``depth`` (positions past it dropped)."""
        if depth >= self.max_depth:
            return self
        sizes = self.level_sizes[: depth + 1]
        return TreeBatch(self.parent[:, : sum(sizes)], sizes, self.max_children, validate=False)

    @cached_property
    def path_nodes(self) -> torch.Tensor:
        """[B, N+1, D]: ``ancestors`` with N+1 (a column past the nodes) instead of -1."""
        return torch.where(self.ancestors >= 0, self.ancestors, self.num_nodes + 1)

    @cached_property
    def postorder(self) -> torch.Tensor:
        """[B, N+1]: the positions in post-order (children in slot order, then the node).
        A node's key is its slot path padded with C past its depth (C sorts after every
        slot, so a node follows its subtree); sorted one depth at a time, last first."""
        digits = torch.where(
            self.ancestors >= 0,
            self.slot.gather(1, self.ancestors.clamp(min=0).flatten(1)).view_as(self.ancestors),
            self.max_children,
        )
        order = torch.arange(self.num_nodes + 1, device=self.parent.device).expand(self.batch_size, -1)
        for k in reversed(range(self.max_depth)):  # a stable sort per digit (radix sort)
            key = digits[..., k].gather(1, order)
            order = order.gather(1, torch.sort(key, dim=1, stable=True).indices)
        return order

    @cached_property
    def postorder_rank(self) -> torch.Tensor:
        """[B, N+1]: each position's place in ``postorder``."""
        places = torch.arange(self.num_nodes + 1, device=self.parent.device).expand(self.batch_size, -1)
        return torch.empty_like(self.postorder).scatter_(1, self.postorder, places)

    @cached_property
    def earlier_siblings(self) -> torch.Tensor:
        """[B, N+1, max(C-1, 1)]: each node's siblings in earlier slots, N+1 padded."""
        c = self.max_children
        width = max(c - 1, 1)
        rows = self.parent.clamp(min=0).unsqueeze(-1).expand(-1, -1, c)
        siblings = self.children.gather(1, rows)[..., :width]  # the parent's children
        column = torch.arange(width, device=self.parent.device)
        keep = (column < self.slot.unsqueeze(-1)) & (siblings >= 0)
        return torch.where(keep, siblings, self.num_nodes + 1)

    @cached_property
    def levels(self) -> list[_BatchLevel]:
        """Per depth 0..D-1, the positions that may have children: a depth's nodes
        with children (each request's, in position order) padded with others, as
        many as the next depth has positions (each child has one parent)."""
        out = []
        for d in range(self.max_depth):
            span, width = self.spans[d], min(self.level_sizes[d], self.level_sizes[d + 1])
            internal = self.is_internal[:, span]
            first = torch.sort(internal.to(torch.uint8), dim=1, descending=True, stable=True).indices[:, :width]
            nodes = first + span.start
            kids = self.children.gather(1, nodes.unsqueeze(-1).expand(-1, -1, self.max_children))
            out.append(_BatchLevel(nodes, kids))
        return out

    @cached_property
    def level_positions(self) -> list[torch.Tensor]:
        """Per depth 0..D-1, LongTensor [n]: every position of the depth, the same for
        all requests (the fused node rules run at each; one without children writes
        no child weight, and the finish reads its own weight, not its stop)."""
        return [torch.arange(span.start, span.stop, device=self.parent.device) for span in self.spans[:-1]]

    @cached_property
    def is_internal_int8(self) -> torch.Tensor:
        """Int8Tensor [B, N+1]: 1 where the node has children (for kernels)."""
        return self.is_internal.to(torch.int8)

    # -------------------------------------------- reads the passes go through
    def children_of(self, nodes: torch.Tensor) -> torch.Tensor:
        """nodes [B] or [B, n] -> [B, C] or [B, n, C]: their children (-1 padded)."""
        flat = nodes.view(nodes.shape[0], -1)
        rows = flat.unsqueeze(-1).expand(-1, -1, self.max_children)
        return self.children.gather(1, rows).view(*nodes.shape, self.max_children)

    def ancestors_of(self, nodes: torch.Tensor) -> torch.Tensor:
        """nodes [B] -> [B, D]: the nodes at depth 1..D on each one's path (-1 past it)."""
        rows = nodes.view(-1, 1, 1).expand(-1, 1, self.max_depth)
        return self.ancestors.gather(1, rows).squeeze(1)

    def at_parents(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, N+1] -> [B, N+1]: x at each position's parent (root and empty: the root)."""
        return x.gather(1, self.parent.clamp(min=0))

    def at_earlier_siblings(self, padded: torch.Tensor) -> torch.Tensor:
        """padded [B, N+2] -> [B, N+1, max(C-1, 1)] (as ``_TreeTensors.at_earlier_siblings``)."""
        return padded.gather(1, self.earlier_siblings.flatten(1)).view_as(self.earlier_siblings)

    def along_paths(self, padded: torch.Tensor) -> torch.Tensor:
        """padded [B, N+2] -> [B, N+1, D] (as ``_TreeTensors.along_paths``)."""
        return padded.gather(1, self.path_nodes.flatten(1)).view_as(self.path_nodes)

    def token_paths(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, N+1] -> [B, N+1, D]: the tokens on each position's path from depth 1
        (its own last), -1 past its depth."""
        picked = tokens.gather(1, self.ancestors.clamp(min=0).flatten(1)).view_as(self.ancestors)
        return torch.where(self.ancestors >= 0, picked, -1)

    @property
    def kid_sizes(self) -> torch.Tensor:
        raise NotImplementedError("subtree sizes per request are not built (univer_wor does not run on a TreeBatch)")

    def __repr__(self) -> str:
        return f"TreeBatch(batch={self.batch_size}, level_sizes={self.level_sizes}, max_children={self.max_children})"


class _BatchLevel:
    """One depth of a TreeBatch: ``nodes`` [B, w] (per request), their ``kids`` [B, w, C]
    (-1 padded). The same reads and writes as ``tree._Level``, by gather and scatter."""

    def __init__(self, nodes: torch.Tensor, kids: torch.Tensor):
        self.nodes = nodes
        self.kids = kids

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, N+1, ...] -> [B, w, ...]: the rows of this level's nodes."""
        index = self.nodes.view(*self.nodes.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:])
        return x.gather(1, index)

    def put(self, x: torch.Tensor, values: torch.Tensor) -> None:
        """x [B, N+1] at this level's nodes <- values [B, w]."""
        x.scatter_(1, self.nodes, values)

    def take_kids(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, N+1] -> [B, w, C]: x at each node's children, 0 where a slot is empty."""
        picked = x.gather(1, self.kids.clamp(min=0).flatten(1)).view_as(self.kids)
        return picked.masked_fill(self.kids < 0, 0)

    def put_kids(self, x: torch.Tensor, values: torch.Tensor) -> None:
        """x [B, N+1] at the children <- values [B, w, C]; empty slots write the root's
        own value back to it (no child is the root, so nothing else is touched)."""
        index = self.kids.clamp(min=0).flatten(1)
        keep = (self.kids >= 0).flatten(1)
        x.scatter_(1, index, torch.where(keep, values.flatten(1).to(x.dtype), x[:, :1].expand_as(index)))
