"""Static shape of a draft token tree.

A tree has a root (node 0: the context, ending in the last committed token) and
N draft nodes 1..N numbered breadth-first, so ``parent[i] < i`` and the nodes of
one depth are contiguous. The children of a node are ordered by *slot*
(0, 1, ...). The shape is shared by every request of a batch; the tokens in it
(and which nodes actually exist) differ per request.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Sequence
from functools import cached_property

import torch

MAX_TREE_NODES = 128  # vLLM's MAX_SPEC_LEN: one target forward verifies at most this many


class TreeSpec:
    """Shape of a draft tree: ``parent``, ``depth``, ``slot`` of nodes 0..N."""

    def __init__(self, paths: Sequence[tuple[int, ...]]):
        # paths[i] = child slots from the root to node i; paths[0] = ().
        self.paths: tuple[tuple[int, ...], ...] = tuple(paths)
        index = {p: i for i, p in enumerate(self.paths)}
        n = len(self.paths)
        parent = [-1] * n
        for i, p in enumerate(self.paths[1:], start=1):
            parent[i] = index[p[:-1]]
        self.parent = torch.tensor(parent, dtype=torch.long)
        self.depth = torch.tensor([len(p) for p in self.paths], dtype=torch.long)
        self.slot = torch.tensor([p[-1] if p else -1 for p in self.paths], dtype=torch.long)
        self.num_nodes = n - 1
        self.max_depth = max(len(p) for p in self.paths)
        self._device_cache: dict[torch.device, _TreeTensors] = {}

    # ------------------------------------------------------------------ build
    @classmethod
    def parse(cls, spec: str | Sequence[Sequence[int]] | TreeSpec) -> TreeSpec:
        """``"WxD"`` (W children per node, depth D; ``"1xD"`` is a chain) or a list of paths."""
        if isinstance(spec, TreeSpec):
            return spec
        if not isinstance(spec, str):
            return cls.from_paths(spec)
        m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", spec)
        if m is None:
            raise ValueError(
                f"malformed tree {spec!r}: expected 'WxD' (e.g. '2x5': 2 children per node, "
                "depth 5) or a list of child-slot paths"
            )
        width, depth = int(m.group(1)), int(m.group(2))
        if width < 1 or depth < 1:
            raise ValueError(f"malformed tree {spec!r}: width and depth must be >= 1")
        num = sum(width**d for d in range(1, depth + 1))
        if num > MAX_TREE_NODES:
            raise ValueError(f"tree {spec!r} has {num} draft nodes; at most {MAX_TREE_NODES} are supported")
        paths = [()]
        for d in range(1, depth + 1):
            paths.extend(itertools.product(range(width), repeat=d))
        return cls(paths)

    @classmethod
    def from_paths(cls, paths: Iterable[Sequence[int]]) -> TreeSpec:
        """Tree from child-slot paths of its draft nodes; every prefix must be listed.

        Within a parent the slots must be 0..m-1 (no gaps); the order of the
        given paths does not matter (nodes are renumbered breadth-first).
        """
        clean: set[tuple[int, ...]] = set()
        for p in paths:
            try:
                t = tuple(int(s) for s in p)
            except (TypeError, ValueError):
                raise ValueError(f"malformed tree: path {p!r} is not a sequence of integers") from None
            if len(t) == 0:
                raise ValueError("malformed tree: the empty path is the root; list draft nodes only")
            if any(s < 0 for s in t):
                raise ValueError(f"malformed tree: path {t} has a negative slot")
            if t in clean:
                raise ValueError(f"malformed tree: path {t} is listed twice")
            clean.add(t)
        if not clean:
            raise ValueError("malformed tree: no draft nodes")
        if len(clean) > MAX_TREE_NODES:
            raise ValueError(f"tree has {len(clean)} draft nodes; at most {MAX_TREE_NODES} are supported")
        for t in clean:
            if len(t) > 1 and t[:-1] not in clean:
                raise ValueError(f"malformed tree: path {t} is listed but its prefix {t[:-1]} is not")
            if t[-1] > 0 and t[:-1] + (t[-1] - 1,) not in clean:
                raise ValueError(
                    f"malformed tree: path {t} is listed but slot {t[-1] - 1} of the same "
                    "parent is not (slots must be 0..m-1)"
                )
        ordered = sorted(clean, key=lambda t: (len(t), t))
        return cls([()] + ordered)

    # ------------------------------------------------------------- structure
    @cached_property
    def num_children(self) -> torch.Tensor:
        """LongTensor [N+1]: number of child slots of each node."""
        counts = torch.zeros(self.num_nodes + 1, dtype=torch.long)
        counts.index_add_(0, self.parent[1:], torch.ones(self.num_nodes, dtype=torch.long))
        return counts

    @cached_property
    def nodes_per_depth(self) -> list[int]:
        """Number of nodes at each depth 0..D (the root alone at depth 0)."""
        return torch.bincount(self.depth, minlength=self.max_depth + 1).tolist()

    @cached_property
    def max_children(self) -> int:
        return int(self.num_children.max())

    @cached_property
    def is_chain(self) -> bool:
        return self.max_children == 1

    @cached_property
    def children(self) -> torch.Tensor:
        """LongTensor [N+1, C]: children of each node in slot order, -1 padded."""
        table = torch.full((self.num_nodes + 1, max(self.max_children, 1)), -1, dtype=torch.long)
        for i in range(1, self.num_nodes + 1):
            table[self.parent[i], self.slot[i]] = i
        return table

    @cached_property
    def ancestors(self) -> torch.Tensor:
        """LongTensor [N+1, D]: ancestors[i, k] = the node at depth k+1 on the path to i (-1 past i)."""
        table = torch.full((self.num_nodes + 1, max(self.max_depth, 1)), -1, dtype=torch.long)
        for i in range(1, self.num_nodes + 1):
            node = i
            while node > 0:
                table[i, self.depth[node] - 1] = node
                node = int(self.parent[node])
        return table

    @cached_property
    def subtree_sizes(self) -> torch.Tensor:
        """LongTensor [N+1]: nodes in each node's subtree, itself included."""
        parent, sizes = self.parent.tolist(), [1] * (self.num_nodes + 1)
        for i in range(self.num_nodes, 0, -1):  # children come after their parents
            sizes[parent[i]] += sizes[i]
        return torch.tensor(sizes, dtype=torch.long)

    @cached_property
    def kid_sizes(self) -> torch.Tensor:
        """LongTensor [N+1, C]: nodes in each child slot's subtree, 0 where none."""
        sizes = self.subtree_sizes[self.children.clamp(min=0)]
        return sizes.masked_fill(self.children < 0, 0)

    @cached_property
    def even_pairs(self) -> bool:
        """Whether child slots 2j and 2j+1 carry subtrees of equal size at every node
        where both exist (regular trees): verifiers that pair siblings then skip the
        work only uneven pairs need."""
        first, second = self.kid_sizes[:, 0:-1:2], self.kid_sizes[:, 1::2]
        return not bool(((first > 0) & (second > 0) & (first != second)).any())

    @cached_property
    def three_child_stage(self) -> bool:
        """Whether univer_wor's three-child stage may run on this shape: a node with three
        leaf children, in a tree of at most three children per node."""
        return self.max_children == 3 and bool(((self.num_children == 3) & (self.kid_sizes == 1).all(-1)).any())

    @cached_property
    def postorder_rank(self) -> torch.Tensor:
        """LongTensor [N+1]: rank of each node in post-order (children in slot order, then the node)."""
        order: list[int] = []

        def visit(v: int) -> None:
            for c in self.children[v].tolist():
                if c >= 0:
                    visit(c)
            order.append(v)

        visit(0)
        rank = torch.empty(self.num_nodes + 1, dtype=torch.long)
        rank[torch.tensor(order)] = torch.arange(self.num_nodes + 1)
        return rank

    @cached_property
    def ancestor_mask(self) -> torch.Tensor:
        """BoolTensor [N+1, N+1]: mask[i, j] = j is i or an ancestor of i (tree attention)."""
        mask = torch.eye(self.num_nodes + 1, dtype=torch.bool)
        for i in range(1, self.num_nodes + 1):
            mask[i] |= mask[self.parent[i]]
        return mask

    def width_cut(self, width: int) -> TreeSpec:
        """The subtree of the nodes whose every step from the root takes a child slot
        below ``width`` (``width`` 1: the chain of first children). Same depth
        wherever slot 0 reaches it; node ids renumbered breadth-first."""
        return TreeSpec([p for p in self.paths if all(slot < width for slot in p)])

    def width_cuts(self) -> list[TreeSpec]:
        """The distinct ``width_cut`` s of this tree, narrowest first, ending with the tree itself."""
        cuts: list[TreeSpec] = []
        for width in range(1, self.max_children + 1):
            cut = self.width_cut(width)
            if not cuts or cut != cuts[-1]:
                cuts.append(cut)
        return cuts

    def internal_levels(self) -> list[torch.Tensor]:
        """Nodes that have child slots, grouped by depth 0..D-1 (each LongTensor [n_d])."""
        has_kids = self.num_children > 0
        return [torch.nonzero(has_kids & (self.depth == d)).flatten() for d in range(self.max_depth)]

    def on(self, device: torch.device | str) -> _TreeTensors:
        """The index tensors the verifiers use, on ``device`` (cached per device)."""
        device = torch.device(device)
        cached = self._device_cache.get(device)
        if cached is None:
            cached = _TreeTensors(self, device)
            self._device_cache[device] = cached
        return cached

    # ------------------------------------------------------------------ misc
    def __repr__(self) -> str:
        return f"TreeSpec(num_nodes={self.num_nodes}, max_depth={self.max_depth}, max_children={self.max_children})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TreeSpec) and self.paths == other.paths

    def __hash__(self) -> int:
        return hash(self.paths)


class _TreeTensors:
    """Per-device index tensors derived from a TreeSpec (built once)."""

    def __init__(self, tree: TreeSpec, device: torch.device):
        self.parent = tree.parent.to(device)
        self.depth = tree.depth.to(device)
        self.slot = tree.slot.to(device)
        self.children = tree.children.to(device)
        self._tree, self._device = tree, device
        self.ancestors = tree.ancestors.to(device)
        self.postorder_rank = tree.postorder_rank.to(device)
        self.is_internal = (tree.num_children > 0).to(device)
        self.levels: list[_Level] = []
        for nodes in tree.internal_levels():
            kids = tree.children[nodes]  # [n, C]
            flat = kids.flatten()
            pos = torch.nonzero(flat >= 0).flatten()
            first, count = int(nodes[0]), len(nodes)
            contiguous = bool((nodes == torch.arange(first, first + count)).all())
            self.levels.append(
                _Level(
                    nodes=nodes.to(device),
                    kids=kids.to(device),
                    kid_pos=pos.to(device),
                    kid_ids=flat[pos].to(device),
                    span=slice(first, first + count) if contiguous else None,
                )
            )

    def children_of(self, nodes: torch.Tensor) -> torch.Tensor:
        """nodes [B] or [B, n] -> their children in slot order, [B, C] or [B, n, C] (-1 padded)."""
        return self.children[nodes]

    def ancestors_of(self, nodes: torch.Tensor) -> torch.Tensor:
        """nodes [B] -> [B, D]: the nodes at depth 1..D on the path to each (-1 past it)."""
        return self.ancestors[nodes]

    def token_paths(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, N+1] -> [B, N+1, D]: the tokens on each node's path from depth 1
        (its own last), -1 past its depth."""
        return tokens[:, self.ancestors.clamp(min=0)].masked_fill(self.ancestors < 0, -1)

    def at_parents(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, N+1] -> [B, N+1]: x at each node's parent (the root reads itself)."""
        return x[:, self.parent.clamp(min=0)]

    def at_earlier_siblings(self, padded: torch.Tensor) -> torch.Tensor:
        """padded [B, N+2] (a column past the nodes) -> [B, N+1, max(C-1, 1)]: padded at
        each node's siblings in earlier slots, the extra column where there are fewer."""
        return padded[:, self.earlier_siblings]

    def along_paths(self, padded: torch.Tensor) -> torch.Tensor:
        """padded [B, N+2] (a column past the nodes) -> [B, N+1, D]: padded at the nodes
        of depth 1..D on each node's path, the extra column past the node's depth."""
        return padded[:, self.path_nodes]

    @cached_property
    def postorder(self) -> torch.Tensor:
        """LongTensor [N+1]: the nodes in post-order (the root last)."""
        return self._tree.postorder_rank.argsort().to(self._device)

    @cached_property
    def earlier_siblings(self) -> torch.Tensor:
        """LongTensor [N+1, max(C-1, 1)]: each node's siblings in earlier child slots,
        padded with N+1 (an index past the nodes: callers append a column there)."""
        tree = self._tree
        n1, children = tree.num_nodes + 1, tree.children.tolist()
        out = torch.full((n1, max(tree.max_children - 1, 1)), n1, dtype=torch.long)
        for kids in children:
            for slot, kid in enumerate(kids):
                if kid >= 0 and slot > 0:
                    out[kid, :slot] = torch.tensor(kids[:slot])
        return out.to(self._device)

    @cached_property
    def path_nodes(self) -> torch.Tensor:
        """LongTensor [N+1, D]: ``ancestors`` (the nodes at depth 1 .. D on the path
        to each node, itself included) with N+1 past the node instead of -1."""
        return torch.where(self.ancestors >= 0, self.ancestors, self._tree.num_nodes + 1)

    @cached_property
    def is_internal_int8(self) -> torch.Tensor:
        """Int8Tensor [N+1]: 1 where the shape gives the node children (for kernels)."""
        return self.is_internal.to(torch.int8)

    @property
    def max_depth(self) -> int:
        return self._tree.max_depth

    @property
    def even_pairs(self) -> bool:
        return self._tree.even_pairs

    @property
    def three_child_stage(self) -> bool:
        return self._tree.three_child_stage

    @cached_property
    def kid_sizes(self) -> torch.Tensor:
        """TreeSpec.kid_sizes on the device (built on first use: only some verifiers read it)."""
        return self._tree.kid_sizes.to(self._device)


class _Level:
    """Internal nodes of one depth: ``nodes`` [n], their ``kids`` [n, C] (-1 padded),
    where the existing kid slots sit in the flattened [n*C] layout, and ``span``
    (a slice) when the nodes are consecutive, so their rows are a view, not a copy."""

    def __init__(self, nodes, kids, kid_pos, kid_ids, span):
        self.nodes = nodes
        self.kids = kids
        self.kid_pos = kid_pos
        self.kid_ids = kid_ids
        self.span = span

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, N+1, ...] -> the rows of this level's nodes [B, n, ...]."""
        return x[:, self.span] if self.span is not None else x[:, self.nodes]

    def put(self, x: torch.Tensor, values: torch.Tensor) -> None:
        """x [B, N+1] at this level's nodes <- values [B, n]."""
        x[:, self.nodes] = values

    def take_kids(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, N+1] -> [B, n, C]: x at each node's children, 0 where a slot is empty."""
        return x[:, self.kids.clamp(min=0)].masked_fill(self.kids < 0, 0)

    def put_kids(self, x: torch.Tensor, values: torch.Tensor) -> None:
        """x [B, N+1] at the children <- values [B, n, C] (empty slots' values dropped)."""
        x[:, self.kid_ids] = values.flatten(1)[:, self.kid_pos]
