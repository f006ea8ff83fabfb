"""Drafting context-aware trees (``tree: "dynamic"``) with vLLM's draft model.

The step of ``TreeDrafter`` (level 0 causal over the missing draft KV, then one
draft forward per depth level, node at position L + depth and slot L + its
position), on the levels ``core.dynamic_tree.level_sizes`` gives the budget.
What differs is how each level's children are chosen, per request:
``plan_children`` gives the ``expand`` best nodes of the level (by draft path
probability, the product of q along the path) their child slots,
``draw_children`` draws them with the ``topk1`` scheme, and ``place_children``
lays them on the next level's positions. So every request has its own parents,
and its own ancestor mask in each draft forward; the shapes of the step stay
fixed (``level_sizes`` positions per level for every request).

Why this is lossless: ``docs/dynamic-trees.md``. Greedy requests (temperature
0) take the top tokens in every slot: argmax matching is exact on any tree.
"""

from __future__ import annotations

import numpy as np
import torch

from ..core.drafting import top_tokens
from ..core.dynamic_tree import DynamicTreeBudget, draw_children, level_sizes, place_children, plan_children
from ..core.fused_tree_pass import triton_reads
from ..core.tree import TreeSpec
from ..core.tree_batch import LevelLayout
from .attention.tree_attention_plan import TreeAttentionPlan
from .draft_inputs import LevelInputs, build_draft_step_inputs
from .host_to_device import upload
from .tree_drafter import TreeDrafter, level_spans, softmax_into


class DynamicTreeDrafter(TreeDrafter):
    """Context-aware trees on ``budget``'s levels; with ``tree: auto`` also the static
    shapes the sizer chooses among (``propose(..., tree=...)``), drafted as ``TreeDrafter``
    drafts them (every verifier that runs on context-aware trees drafts ``topk1``)."""

    def __init__(self, runner, proposer, budget: DynamicTreeBudget, state, timers, tree=None):
        self.budget = budget
        self.layout = LevelLayout(level_sizes(budget), budget.max_children)
        super().__init__(runner, proposer, self.layout if tree is None else tree, "topk1", state, timers)
        self._query_starts: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def _use(self, tree: LevelLayout | TreeSpec) -> None:
        if not isinstance(tree, LevelLayout):
            return super()._use(tree)
        if tree != self.layout:
            raise ValueError(f"the dynamic drafter lays its trees on {self.layout}, not on {tree}")
        self.tree = tree
        self.level_span = level_spans(tree)
        self.last_run_node = self.level_span[tree.max_depth - 1][1]  # the deepest level is never run
        self.child_groups = None  # children are placed per request, not by a shared table

    def _draft_levels(self, active, roots, block_rows, block_size, temperature, greedy, generators, banned, cut):
        """Every active request's tree on the shared levels, down to the deepest ``cut``
        (int64 [R], deepest first; a request cut shallower is sent its prefix: the
        nodes below it are drawn but never verified). Returns (tokens [R, N+1],
        q [R, N+1, V], parents [R, N+1]); a static shape (``tree: auto``) as
        ``TreeDrafter`` drafts it."""
        if not isinstance(self.tree, LevelLayout):
            return super()._draft_levels(
                active, roots, block_rows, block_size, temperature, greedy, generators, banned, cut
            )
        layout, runner = self.tree, self.runner
        device = runner.device
        reqs, n1, depth = len(active), layout.num_nodes + 1, int(cut[0])
        sizes, m = layout.level_sizes, layout.max_children
        step = build_draft_step_inputs(roots, self.level_span, depth, block_rows, block_size, device, [reqs] * depth)
        max_context_len = int(roots.root_bound.max())
        level = step.levels[0]
        hidden = self._forward(level.token_ids, level, step.block_table, plan=None)
        logits = self._logits(hidden[step.root_rows]).unsqueeze(1)  # [R, 1, V]: the roots
        vocab = logits.shape[-1]

        tokens = torch.full((reqs, n1), -1, dtype=torch.long, device=device)
        tokens[:, 0] = step.root_tokens
        parents = torch.full_like(tokens, -1)
        # mask[r, i, j]: position j is i or an ancestor of i in request r's tree (built level by level).
        mask = torch.zeros(reqs, n1, n1, dtype=torch.bool, device=device)
        mask[:, 0, 0] = True
        # q rows of every request (greedy ones too: their scores rank the frontier);
        # the deepest level's rows are never a draw's law: zero, as TreeDrafter leaves them.
        batch_ids = runner.input_batch.req_ids
        q = self._q_buffer((reqs, n1, vocab), {batch_ids[i] for i in active})
        q[:, self.level_span[depth][0] :] = 0.0
        temp = upload(temperature, device).view(-1, 1, 1)
        greedy_rows = upload(greedy, device).view(-1, 1, 1) if bool(greedy.any()) else None
        row_of = {int(b): r for r, b in enumerate(active)} if generators else {}
        seeded = [(row_of[b], g) for b, g in generators.items() if b in row_of and not bool(greedy[row_of[b]])]
        scores = torch.ones(reqs, 1, dtype=q.dtype, device=device)
        kept = None  # the level's nodes that ran its forward (None: all of them)
        for d in range(depth):
            first, last = self.level_span[d]
            if kept is None:
                rows = self._level_rows(q, d, logits, temp, banned)  # [R, F, V], written into q
            else:
                rows = self._kept_rows(q, d, logits, kept, temp, banned)
            slots = torch.full((reqs,), sizes[d + 1], dtype=torch.long, device=device)
            k = plan_children(scores, rows, self.budget, slots)
            fused = triton_reads(rows)
            if fused:  # CUDA: every draw and the greedy rows' top tokens in one launch
                from ..core.kernels.triton_draft_children import draft_children_fused

                greedy_flags = None if greedy_rows is None else greedy_rows.view(-1)
                kids = draft_children_fused("topk1", rows, self._range(rows.shape[1]), m, greedy_flags, node_children=k)
            else:
                kids = draw_children(rows, k, m)
            for row, generator in seeded:  # seeded requests draw from their own generator
                kids[row] = draw_children(rows[row : row + 1], k[row : row + 1], m, generator)[0]
            if greedy_rows is not None and not fused:
                top = top_tokens(rows, m)
                top = torch.where(torch.arange(m, device=device) < k.unsqueeze(-1), top, -1)
                kids = torch.where(greedy_rows, top, kids)
            below, level_tokens = place_children(scores, k, kids, sizes[d + 1])
            nxt_first, nxt_last = self.level_span[d + 1]
            parent = torch.where(below >= 0, below + first, -1)
            parents[:, nxt_first : nxt_last + 1] = parent
            tokens[:, nxt_first : nxt_last + 1] = level_tokens
            # The next level's draft path probabilities and ancestor rows.
            safe = below.clamp(min=0)
            q_of_token = rows.flatten(1).gather(1, safe * vocab + level_tokens.clamp(min=0))
            scores = torch.where(level_tokens >= 0, scores.gather(1, safe) * q_of_token, 0.0)
            inherited = mask.gather(1, parent.clamp(min=0).unsqueeze(-1).expand(-1, -1, n1)) & (parent >= 0).unsqueeze(
                -1
            )
            own = torch.arange(nxt_first, nxt_last + 1, device=device)
            mask[:, nxt_first : nxt_last + 1] = inherited | (torch.arange(n1, device=device) == own.unsqueeze(-1))
            if d + 1 == depth:
                break
            width = nxt_last - nxt_first + 1
            level = step.levels[d + 1]
            node_ids = tokens[:, nxt_first : nxt_last + 1].clamp(min=0)
            level_mask = mask[:, nxt_first : nxt_last + 1, : nxt_last + 1]
            kept = self._nodes_to_run(scores)
            run = width if kept is None else kept.shape[1]
            if kept is not None:
                node_ids = node_ids.gather(1, kept)
                level_mask = level_mask.gather(1, kept.unsqueeze(-1).expand(-1, -1, nxt_last + 1))
                level = self._kept_inputs(level, kept, width)
            plan = TreeAttentionPlan(
                query_rows=self._range(reqs * run).view(reqs, run),
                row_valid=None,
                request_index=self._range(reqs),
                context_lens=step.context_lens,
                mask=level_mask,
                covers_all_rows=True,
                max_context_len=max_context_len,
            )
            hidden = self._forward(node_ids.flatten(), level, step.block_table, plan=plan)
            logits = self._logits(hidden).view(reqs, run, vocab)
        return tokens, q, parents

    def _nodes_to_run(self, scores: torch.Tensor) -> torch.Tensor | None:
        """Which nodes of a level run its draft forward, [R, expand] (None: all):
        only the ``expand`` best get children (``plan_children`` ranks them by their
        path probability ``scores`` [R, width], known now, ties to the lower index),
        so only their rows are ever drawn from. The others stay leaves, their draft KV unwritten."""
        if self.budget.expand >= scores.shape[1]:
            return None
        return torch.sort(scores, dim=1, descending=True, stable=True).indices[:, : self.budget.expand]

    def _kept_inputs(self, level: LevelInputs, kept: torch.Tensor, width: int) -> LevelInputs:
        """``level`` (every node of a level of ``width`` per request) cut to the nodes
        ``kept`` [R, run] of each request: their cache slots, one position for all."""
        reqs, run = kept.shape
        if (reqs, run) not in self._query_starts:
            starts = np.arange(reqs + 1, dtype=np.int32) * run
            self._query_starts[reqs, run] = (upload(starts, self.runner.device), torch.from_numpy(starts))
        starts, starts_cpu = self._query_starts[reqs, run]
        return level._replace(
            positions=level.positions.view(reqs, width)[:, :run].reshape(-1),
            slot_mapping=level.slot_mapping.view(reqs, width).gather(1, kept).view(-1),
            query_start_loc=starts,
            query_start_loc_cpu=starts_cpu,
            max_query_len=run,
        )

    def _kept_rows(self, q, depth: int, logits: torch.Tensor, kept: torch.Tensor, temp, banned) -> torch.Tensor:
        """The depth-``depth`` level's q rows [R, F, V] from the logits [R, run, V] of
        its nodes ``kept`` [R, run] (written into ``q``); the other nodes' rows zero."""
        first, last = self.level_span[depth]
        rows = q[:, first : last + 1]
        run_rows = softmax_into(torch.empty(logits.shape, dtype=q.dtype, device=q.device), logits, temp, banned)
        rows.zero_()
        return rows.scatter_(1, kept.unsqueeze(-1).expand(-1, -1, logits.shape[-1]), run_rows)
