"""What one engine step leaves for the next: the drafted trees and the draft cache fill.

Requests are keyed by id, not batch row: vLLM reorders its batch between steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..core.tree import TreeSpec
from ..core.tree_batch import LevelLayout, TreeBatch
from .step_buffer import StepBuffer


@dataclass
class DraftedTrees:
    """The trees proposed at the end of one step, for the next step's verifier.

    tokens: LongTensor [B, N+1], node tokens (column 0 = the root; -1 = no node).
    draft_probs: FloatTensor [B, M, V], row i = q node i's children were drawn
        from, for the M <= N+1 nodes down to the deepest level drafted (a depth
        cut keeps no rows below it; the deepest level's rows are zero); None when
        every request of the batch was greedy (argmax matching never reads q, and
        the drafter then never builds it).
    tree: the shape drafted (node ids are its own; with ``tree: auto`` a width
        cut of ``max_tree``, each row cut to its own depth); for context-aware
        trees the levels they share (``LevelLayout``), their parents in ``parents``.
    parents: LongTensor [B, N+1] or None: each request's parent of each position
        (context-aware trees, ``TreeBatch``).
    """

    req_ids: list[str]
    tokens: torch.Tensor
    draft_probs: torch.Tensor | None
    tree: TreeSpec | LevelLayout
    parents: torch.Tensor | None = None


@dataclass
class TreeState:
    """Per-request bookkeeping shared by the tree drafter and the tree verifier."""

    # Each request's latest tree: (the batch it was drafted in, its row there).
    # A request the scheduler skips for a step keeps its tree (and its scheduled drafts).
    trees: dict[str, tuple[DraftedTrees, int]] = field(default_factory=dict)
    # Leading positions of each request whose draft-model KV is in the cache.
    draft_kv_len: dict[str, int] = field(default_factory=dict)
    # A bound on each request's new tokens this step (1 + the depth its tree was
    # verified to), left by the verifier for the drafter (``take_max_new_tokens``).
    max_new_tokens: dict[str, int] = field(default_factory=dict)
    # The shape of the trees drafted last: what the next step verifies (the runner
    # seeds it with the configured tree). All trees of one drafting share a shape;
    # a tree of another shape (its request was skipped for a step while the shape
    # changed) is verified as no tree at all.
    latest_tree: TreeSpec | None = None
    # The context-aware trees of the step being verified (``step_trees``): the target
    # forward's masks and the verifier read one TreeBatch. Key: (req ids, layout, device).
    _step_batch: tuple[tuple, TreeBatch] | None = None
    # Where ``gather`` puts q rows it reorders (requests in another order than drafted):
    # a buffer kept across steps, so the verification graphs find them at one address.
    reordered_q: StepBuffer | None = None

    def add(self, drafted: DraftedTrees) -> None:
        self.latest_tree = drafted.tree
        self._step_batch = None
        for row, req_id in enumerate(drafted.req_ids):
            self.trees[req_id] = (drafted, row)

    def gather(self, req_ids: list[str], tree: TreeSpec | None = None, num_rows: int | None = None):
        """Trees of ``req_ids`` (of shape ``tree`` when given; others count as
        absent) -> (tokens [B, N+1], q [B, M, V] or None (M: ``num_rows`` when
        given, else the most rows any of them has), found [B], q_missing BoolTensor [B] or None).

        One gather when the requests were drafted together (the usual case);
        requests without a tree get tokens -1 (only the root exists) and q rows
        copied from another request (never read: a root without children). q is
        None when no tree has one; otherwise rows of trees drafted without q are
        zero and flagged in ``q_missing`` (greedy requests: the caller fills them).
        """
        entries = [self.trees.get(r) for r in req_ids]
        if tree is not None:
            entries = [e if e is not None and e[0].tree == tree else None for e in entries]
        found = [e is not None for e in entries]
        present = [e for e in entries if e is not None]
        if not present:
            return None, None, found, None
        batches = {id(e[0]): e[0] for e in present}
        q_missing = None
        if len(batches) == 1:
            drafted = present[0][0]
            rows = [e[1] if e is not None else 0 for e in entries]
            q = drafted.draft_probs
            if rows == list(range(drafted.tokens.shape[0])):  # same requests, same order: no copy
                tokens = drafted.tokens
            else:
                index = torch.tensor(rows, device=drafted.tokens.device)
                tokens = drafted.tokens[index]
                if q is not None and self.reordered_q is not None:
                    q = torch.index_select(q, 0, index, out=self.reordered_q.get((len(rows), *q.shape[1:])))
                elif q is not None:
                    q = q[index]
        else:
            filler = present[0]
            rows = [e if e is not None else filler for e in entries]
            tokens = torch.stack([b.tokens[i] for b, i in rows])
            with_q = [b.draft_probs for b, _ in rows if b.draft_probs is not None]
            if not with_q:
                q = None
            else:
                # Trees drafted to different depths keep different numbers of rows:
                # the missing deeper rows are zero, like a drafted tree's deepest level.
                most = max(x.shape[1] for x in with_q)
                zero = with_q[0].new_zeros(most, with_q[0].shape[2])

                def rows_of(b, i):
                    if b.draft_probs is None:
                        return zero
                    return torch.nn.functional.pad(b.draft_probs[i], (0, 0, 0, most - b.draft_probs.shape[1]))

                q = torch.stack([rows_of(b, i) for b, i in rows])
                q_missing = torch.tensor([b.draft_probs is None for b, _ in rows], device=tokens.device)
        if q is not None and num_rows is not None:
            q = q[:, :num_rows]  # a view: no [B, N+1, V] copy per step
            if num_rows > q.shape[1]:
                # A tree drafted without q (all greedy) may reach deeper than every tree with one.
                q = torch.nn.functional.pad(q, (0, 0, 0, num_rows - q.shape[1]))
        missing = torch.tensor([not f for f in found], device=tokens.device)
        return tokens.masked_fill(missing.unsqueeze(1), -1), q, found, q_missing

    def parents_of(self, req_ids: list[str], layout: LevelLayout, device) -> torch.Tensor:
        """[B, N+1]: the parents of each request's context-aware tree drafted on
        ``layout``; a request without one gets only the root (-1 elsewhere), as
        ``gather`` gives it no tokens. One index per batch the trees come from."""
        n1 = layout.num_nodes + 1
        out = torch.full((len(req_ids), n1), -1, dtype=torch.long, device=device)
        by_batch: dict[int, tuple[DraftedTrees, list[int], list[int]]] = {}
        for row, req_id in enumerate(req_ids):
            entry = self.trees.get(req_id)
            if entry is None or entry[0].tree != layout or entry[0].parents is None:
                continue
            drafted, _, _ = by_batch.setdefault(id(entry[0]), (entry[0], [], []))
            by_batch[id(entry[0])][1].append(row)
            by_batch[id(entry[0])][2].append(entry[1])
        for drafted, rows, sources in by_batch.values():
            index = torch.tensor(sources, device=device)
            out[torch.tensor(rows, device=device)] = drafted.parents[index, :n1]
        return out

    def step_trees(self, req_ids: list[str], layout: LevelLayout, device) -> TreeBatch:
        """``parents_of`` as a TreeBatch on ``layout``, built once per step: the target
        forward's masks and the verifier ask for the same batch."""
        key = (tuple(req_ids), layout, torch.device(device))
        if self._step_batch is None or self._step_batch[0] != key:
            parents = self.parents_of(req_ids, layout, device)
            self._step_batch = (key, TreeBatch(parents, layout.level_sizes, layout.max_children, validate=False))
        return self._step_batch[1]

    def take_max_new_tokens(self, req_ids: list[str]) -> np.ndarray:
        """int64 [B]: the bound on each request's new tokens this step (1 where no tree
        was verified), taken once: a step that verifies no tree leaves none behind."""
        bounds, self.max_new_tokens = self.max_new_tokens, {}
        return np.array([bounds.get(r, 1) for r in req_ids], dtype=np.int64)

    def forget(self, req_ids) -> None:
        """Drop the trees of ``req_ids``: they got no tree this step, so theirs is never verified again."""
        self._step_batch = None
        for req_id in req_ids:
            self.trees.pop(req_id, None)

    def forget_except(self, live_req_ids: list[str]) -> None:
        live = set(live_req_ids)
        self._step_batch = None
        self.draft_kv_len = {r: n for r, n in self.draft_kv_len.items() if r in live}
        self.trees = {r: t for r, t in self.trees.items() if r in live}
