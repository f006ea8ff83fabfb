"""Drafting a token tree per request with vLLM's draft model, level by level.

For each request whose step produced a token (the new root, at position L):

* level 0 runs, causally, every token whose draft KV is missing: after a verified
  tree its last two tokens (the node below the root, never run when the path
  ended on a leaf, and the root), and the whole prompt after prefill. Where the
  root lies is known on the device only: the inputs are laid out on the host and
  moved there by the accepted count (``draft_inputs``), so nothing waits for
  the verification until every draft forward is launched;
* level d = 1 .. D-1 runs the tree nodes of depth d, at RoPE position L + d,
  written to slot L + node, each attending to the context and to its own
  ancestors only (``TreeAttentionPlan`` read from the draft layers' cache).

The children of every node are drawn from its exact draft row q with the
verifier's scheme (temperature > 0: q = softmax(logits / T) over the request's
allowed tokens; temperature 0: the top tokens). Trees and q rows are kept for the next step's verifier.
Loops run over depth levels and over the (few) distinct child counts of a level.
"""

from __future__ import annotations

import itertools
import os
from typing import NamedTuple

import numpy as np
import torch
from vllm.v1.attention.backend import CommonAttentionMetadata

from ..core.drafting import draft_children, top_tokens
from ..core.fused_tree_pass import triton_reads
from ..core.tree import TreeSpec
from ..sizing.catch_up import MIN_CATCH_UP_TOKENS, split_catch_up
from .attention.tree_attention_plan import TreeAttentionPlan
from .draft_forward import draft_model_inputs, run_draft_model
from .draft_inputs import DraftRoots, LevelInputs, build_catch_up_inputs, build_draft_step_inputs, new_token_counts
from .draft_level_graphs import DraftLevelGraphs
from .host_to_device import upload
from .sampling.target_probs import softmax_, split_greedy
from .step_buffer import KeptRange, StepBuffer
from .tree_state import DraftedTrees, TreeState

# Test hook: the catch-up budget of every step, in tokens (at least ``MIN_CATCH_UP_TOKENS``):
# small, every new prompt is caught up by chunks over several steps.
CATCH_UP_ENV = "VLLM_UNIVER_CATCH_UP_TOKENS"


class TreeDrafter:
    def __init__(self, runner, proposer, tree: TreeSpec, scheme: str, state: TreeState, timers):
        self.runner = runner
        self.proposer = proposer  # vLLM's DraftModelProposer: the loaded draft model and its attention groups
        self.scheme = scheme
        self.state = state
        self.timers = timers
        self._shapes: dict[TreeSpec, _Shape] = {}
        self._use(tree)
        self.q_rows = StepBuffer(runner.device)  # the draft rows q, [B, N+1, V]
        self.forward_tokens: list[int] = []  # query tokens of each draft forward of the last step
        # ``cuda_graphs: full``: the level forwards whose requests all run as many
        # tokens replay full graphs (``DraftLevelGraphs``, set by ``TreeSpeculation``).
        self.level_graphs: DraftLevelGraphs | None = None
        self._range = KeptRange(runner.device)  # 0 .. n-1, views of one kept range (no launch per level)
        self.catch_up_chunks = 0  # catch-up chunks run (``_catch_up``): tests, benchmarks
        self.chunk_tokens = 0  # tokens of the last step's catch-up chunk (0: none ran)

    def _use(self, tree: TreeSpec) -> None:
        """Draft ``tree`` from now on (``tree: auto`` switches among width cuts)."""
        if tree not in self._shapes:
            self._shapes[tree] = _Shape(tree, self.runner.device)
        shape = self._shapes[tree]
        self.tree = tree
        self.level_span, self.last_run_node, self.child_groups = shape.level_span, shape.last_run_node, shape.groups

    # ------------------------------------------------------------------ step
    def propose(
        self,
        sampled_token_ids,
        sampling_metadata,
        depth=None,
        tree: TreeSpec | None = None,
        launched=None,
        catch_up_budget: int | None = None,
    ):
        """Draft a tree of shape ``tree`` (None: the last one), cut to ``depth``
        (None: the whole tree; 0: none; an int, or one per batch row), for
        every request that got tokens this step.

        catch_up_budget: at most this many tokens the draft has not seen (new
        prompts, the tokens of plain steps) run this step besides the usual two
        per request, and never more than the step's token budget leaves after the
        target's (None: that; at least ``MIN_CATCH_UP_TOKENS``): a request further
        behind runs a chunk and drafts in a later step (``_catch_up``), so that no
        step stalls the batch.

        sampled_token_ids: the verifier's output [B, D+1] (-1 padded) on the device,
        before the runner's bookkeeping has appended it to the batch's token lists.
        Nothing derived from it is read on the host until every draft forward is
        launched (``draft_inputs``): then ``launched()`` runs (host work that waited
        for the verification), and the drafts are read back.
        Returns vLLM's draft lists: the nodes of depth <= ``depth`` in
        breadth-first order per request (a node that does not exist is sent as
        token 0 and ignored by the verifier), [] for requests without a tree.
        The verifier reads a breadth-first prefix as the tree cut to its last full level.
        """
        if tree is not None:
            self._use(tree)
        runner, tree = self.runner, self.tree
        self.forward_tokens = []
        input_batch = runner.input_batch
        batch = input_batch.num_reqs
        depths = np.broadcast_to(np.asarray(tree.max_depth if depth is None else depth, dtype=np.int64), (batch,))
        depths = np.minimum(depths, tree.max_depth)  # a width cut may be shallower than max_tree
        req_ids = input_batch.req_ids[:batch]
        # Requests the scheduler skipped this step are out of the batch but still live.
        self.state.forget_except(runner.requests.keys())
        block_table = input_batch.block_table[0]
        block_size = block_table.block_size

        committed = input_batch.num_tokens_no_spec[:batch].astype(np.int64)
        max_new = self.state.take_max_new_tokens(req_ids)  # 1 unless a tree was verified
        got_token = ~runner.discard_request_mask.np[:batch]
        root_bound = committed + max_new - 1
        capacity = block_table.num_blocks_per_row[:batch].astype(np.int64) * block_size
        fits = (root_bound + self.last_run_node < capacity) & (root_bound + tree.max_depth < runner.max_model_len)
        # A verified request's draft KV holds its old root and the accepted nodes the
        # drafter ran: level 0 runs its last two tokens. One that holds less (never
        # seen) catches up in a step without a verified tree.
        draft_kv = np.array([self.state.draft_kv_len.get(r, 0) for r in req_ids], dtype=np.int64)
        verified = max_new > 1
        start = np.minimum(draft_kv, committed - verified)
        # A request cut to depth 0 gets no tree; the draft cache catches up when a later step drafts.
        active = np.nonzero(got_token & fits & (depths > 0) & ~(verified & (draft_kv < committed - 1)))[0]
        active = self._catch_up(active, start, committed, block_table, catch_up_budget)
        drafts: list[list[int]] = [[] for _ in range(batch)]
        # The batch's other requests get no tree: an older one of theirs is never verified again.
        with_tree = set(active.tolist())
        self.state.forget([r for i, r in enumerate(req_ids) if i not in with_tree])
        if active.size == 0:
            if launched is not None:
                launched()
            return drafts
        # Deepest cuts first: the forward of level d runs the requests cut below d, a prefix.
        active = active[np.argsort(-depths[active], kind="stable")]
        cut = depths[active]
        active_ids = [req_ids[i] for i in active]
        new_tokens = _on_device(sampled_token_ids, runner.device)[upload(active, runner.device)]
        roots = DraftRoots(
            start=start[active],
            committed=committed[active],
            max_new=max_new[active],
            committed_tokens=[input_batch.token_ids_cpu[i, start[i] : committed[i]].tolist() for i in active.tolist()],
            new_tokens=new_tokens,
            new_counts=new_token_counts(new_tokens),
        )
        block_rows = block_table.get_cpu_tensor()[torch.from_numpy(active)]
        temperature, greedy = self._draft_temperature(active)

        banned = sampling_metadata.allowed_token_ids_mask
        if banned is not None:  # draft inside the allowed set: other drafts would always be rejected
            banned = banned[upload(active, banned.device)]
        tokens, q, parents = self._draft_levels(
            active, roots, block_rows, block_size, temperature, greedy, sampling_metadata.generators, banned, cut
        )
        self._clear_q_below_cuts(q, cut)
        if launched is not None:
            launched()
        node_tokens = tokens[:, 1:].clamp(min=0).tolist()
        # The draft cache now holds the context and the root (its shift clamped as the inputs clamp it).
        new_counts = np.clip(roots.new_counts.cpu().numpy(), 1, roots.max_new)
        for req_id, kv_len in zip(active_ids, (roots.committed + new_counts).tolist()):
            self.state.draft_kv_len[req_id] = kv_len
        self.state.add(DraftedTrees(active_ids, tokens, q, tree, parents))
        for row, (i, d) in enumerate(zip(active.tolist(), cut.tolist())):
            drafts[i] = node_tokens[row][: self.level_span[d][1]]
        return drafts

    def _catch_up(self, active, start, committed, block_table, budget: int | None) -> np.ndarray:
        """The ``active`` batch rows that draft this step, with the draft's catch-up
        bounded like a chunked prefill (``sizing.catch_up``): level 0 runs, besides
        each root and the node below it, at most ``budget`` committed tokens the draft
        has not seen over the step, the rows least behind first. The first row that
        does not fit runs a chunk of its own in a forward of its own (its KV is all it
        writes) and no tree; the others that do not fit wait. A request that stops
        speculating thus costs the draft nothing, and its catch-up is spread over the
        steps where it speculates again."""
        runner = self.runner
        self.chunk_tokens = 0
        # What the scheduler's token budget leaves after the target's tokens (a chunked prefill's rule).
        left = runner.scheduler_config.max_num_batched_tokens - int(runner.query_start_loc.np[len(start)])
        budget = left if budget is None else min(budget, left)
        budget = max(int(os.environ.get(CATCH_UP_ENV, budget)), MIN_CATCH_UP_TOKENS)
        fits, first, chunk = split_catch_up(np.maximum(committed[active] - start[active] - 1, 0), budget)
        if chunk > 0:
            row = int(active[first])
            begin = int(start[row])
            tokens = runner.input_batch.token_ids_cpu[row, begin : begin + chunk].tolist()
            block_rows = block_table.get_cpu_tensor()[row : row + 1]
            token_ids, level, table = build_catch_up_inputs(
                np.array([begin]), [tokens], block_rows, block_table.block_size, runner.device
            )
            self._forward(token_ids, level, table, plan=None)
            self.state.draft_kv_len[runner.input_batch.req_ids[row]] = begin + chunk
            self.catch_up_chunks += 1
            self.chunk_tokens = chunk
        return active[fits]

    def _clear_q_below_cuts(self, q: torch.Tensor | None, cut: np.ndarray) -> None:
        """Zero the q rows a request's levels never wrote (the buffer is reused across
        steps): those of its cut's leaves (read at a leaf end node, never drawn from)
        and below. Its nodes below the cut were never drawn: -1 already."""
        if q is None:
            return
        for d in np.unique(cut)[:-1].tolist():  # the deepest cut's leaf rows: zeroed in _draft_levels
            q[upload(np.nonzero(cut == d)[0], q.device), self.level_span[d][0] :] = 0.0

    def _draft_temperature(self, active: np.ndarray):
        """(temperature [R], greedy [R]) of the active rows, from vLLM's host copy
        of the batch's temperatures (0 for greedy requests): no device read."""
        return split_greedy(torch.from_numpy(self.runner.input_batch.temperature_cpu[active].astype(np.float32)))

    def _draft_levels(self, active, roots, block_rows, block_size, temperature, greedy, generators, banned, cut):
        """The levels of every active request's tree, each request to its ``cut``
        (int64 [R], deepest first): level d's forward runs the requests cut below d only.
        Returns (tokens [R, N+1], q [R, M, V] or None, parents [R, N+1] or None: the
        requests' own parents where each has its own shape)."""
        tree, runner = self.tree, self.runner
        device = runner.device
        reqs = len(active)
        n1 = tree.num_nodes + 1
        depth = int(cut[0])
        level_reqs = [int((cut > d).sum()) for d in range(depth)]

        # Level 0: the tokens whose draft KV is missing, causally, up to the root.
        # Every level's inputs are built and sent to the device here, once per step.
        step = build_draft_step_inputs(roots, self.level_span, depth, block_rows, block_size, device, level_reqs)
        root_bound = roots.root_bound
        level = step.levels[0]
        hidden = self._forward(level.token_ids, level, step.block_table, plan=None)
        root_logits = self._logits(hidden[step.root_rows])

        vocab = root_logits.shape[-1]
        tokens = torch.full((reqs, n1), -1, dtype=torch.long, device=device)
        tokens[:, 0] = step.root_tokens
        # Host-side facts about the rows decided once here: the level loop reads no device value.
        greedy = GreedyRows(upload(greedy, device, torch.int8), greedy, bool(greedy.any()), bool(greedy.all()))
        all_greedy = greedy.all
        q = None
        if not all_greedy:
            # Rows of internal nodes are written level by level; leaf rows are never a
            # draw's law but the verifier reads them at a leaf end node: keep them finite.
            # Rows down to the deepest level drafted only: a 2x5 cut to depth 1 keeps
            # 3 rows of 63 (the rest would be zeroed and carried for nothing).
            batch_ids = self.runner.input_batch.req_ids
            first, last = self.level_span[depth]
            q = self._q_buffer((reqs, last + 1, vocab), {batch_ids[i] for i in active})
            q[:, first:] = 0.0
        temp = upload(temperature, device).view(-1, 1)
        self._draw_children(
            0,
            tokens,
            self._level_rows(q, 0, root_logits.unsqueeze(1), temp.unsqueeze(-1), banned),
            greedy,
            generators,
            active,
        )

        for d in range(1, depth):
            first, last = self.level_span[d]
            width, n = last - first + 1, level_reqs[d]  # the first n requests are cut below d
            node_ids = tokens[:n, first : last + 1].clamp(min=0).flatten()  # stays on the device
            # A chain's node at depth d (position and slot L + d) sees the context and
            # its ancestors, the slots just below it: causal attention, vLLM's kernel.
            plan = None
            if not tree.is_chain:
                plan = TreeAttentionPlan(
                    query_rows=self._range(n * width).view(n, width),
                    row_valid=None,
                    request_index=self._range(n),
                    context_lens=step.context_lens[:n],
                    mask=self._shapes[tree].level_masks[d],
                    covers_all_rows=True,
                    max_context_len=int(root_bound[:n].max()),
                )
            hidden = self._forward(node_ids, step.levels[d], step.block_table[:n], plan=plan)
            logits = self._logits(hidden).view(n, width, vocab)
            rows = self._level_rows(
                None if q is None else q[:n], d, logits, temp[:n].unsqueeze(-1), None if banned is None else banned[:n]
            )
            # Views of the first n rows: the draws land in ``tokens`` itself.
            self._draw_children(d, tokens[:n], rows, greedy.first(n), generators, active[:n])
        return tokens, q, None  # one shape for every request: no parents of their own

    def _level_rows(self, q, depth: int, logits: torch.Tensor, temp: torch.Tensor, banned) -> torch.Tensor:
        """What the children of the depth-``depth`` nodes are drawn from, [R, width, V]:
        their q rows (softmax(logits / T) over the allowed tokens, written into ``q``),
        or, when every request is greedy (``q`` None), the masked logits themselves
        (the top tokens are the same; no softmax, no q kept)."""
        if q is None:
            return _masked(logits, None if banned is None else banned.unsqueeze(1))
        first, last = self.level_span[depth]
        return softmax_into(q[:, first : last + 1], logits, temp, banned)

    def _q_buffer(self, shape: tuple[int, int, int], replaced: set[str]) -> torch.Tensor:
        """This step's q rows, in the buffer kept across steps unless a tree that
        is not ``replaced`` this step (a request the scheduler skipped) still reads the old rows."""
        if any(
            self.q_rows.holds(drafted.draft_probs)
            for req_id, (drafted, _) in self.state.trees.items()
            if req_id not in replaced
        ):
            self.q_rows.release()
        return self.q_rows.get(shape)

    def _draw_children(self, depth, tokens, level_rows, greedy, generators, active) -> None:
        """Children of the depth-``depth`` nodes, drawn from their rows ``level_rows``
        [R, width, V] (q; or logits when every request is greedy): on CUDA one
        Triton launch per child count (``core/kernels/triton_draft_children.py``, the
        same law), else ``drafting.draft_children``."""
        row_of = {int(b): r for r, b in enumerate(active)} if generators else {}
        seeded = [(row_of[b], g) for b, g in generators.items() if b in row_of and not bool(greedy.host[row_of[b]])]
        fused = triton_reads(level_rows)
        for parents, kids, m, in_level, in_level_index in self.child_groups[depth]:
            if fused:
                from ..core.kernels.triton_draft_children import draft_children_fused

                some_greedy = greedy.rows if greedy.any and not greedy.all else None
                # Unseeded, the kernel writes the children into ``tokens`` itself.
                into = None if seeded else (tokens, parents, kids)
                drawn = draft_children_fused(
                    self.scheme, level_rows, in_level_index, m, some_greedy, greedy.all, into=into
                )
                if into is not None:
                    continue
            else:
                rows = level_rows[:, in_level]  # [R, g, V]
                if greedy.all:
                    drawn = top_tokens(rows, m)
                else:
                    drawn = draft_children(self.scheme, rows, m)
                    if greedy.any:
                        drawn = torch.where(greedy.rows.view(-1, 1, 1).bool(), top_tokens(rows, m), drawn)
            # Seeded requests draw from their own generator (outputs independent of the batch).
            for row, generator in seeded:
                drawn[row] = draft_children(self.scheme, level_rows[row, in_level], m, generator=generator)
            missing_parent = (tokens[:, parents] < 0).unsqueeze(-1)
            tokens[:, kids.flatten()] = drawn.masked_fill(missing_parent, -1).flatten(1)

    # --------------------------------------------------------------- forward
    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with self.timers.measure("draft_forward"):
            return self.proposer.model.compute_logits(hidden)

    def _forward(
        self, token_ids: torch.Tensor, level: LevelInputs, block_table: torch.Tensor, plan: TreeAttentionPlan | None
    ) -> torch.Tensor:
        """One draft-model forward over a flat batch of tokens.

        token_ids: [T] on the device; level: the forward's positions, slots and
        query layout (``draft_inputs``); block_table: IntTensor [R, blocks] on the device.
        """
        proposer = self.proposer
        num_tokens = len(token_ids)
        self.forward_tokens.append(num_tokens)
        if self.level_graphs is not None:
            with self.timers.measure("draft_forward"):
                hidden = self.level_graphs.forward(token_ids, level, block_table, plan)
            if hidden is not None:
                return hidden
        slot_mapping = level.slot_mapping
        common = CommonAttentionMetadata(
            query_start_loc=level.query_start_loc,
            query_start_loc_cpu=level.query_start_loc_cpu,
            seq_lens=level.seq_lens,
            num_reqs=len(level.seq_lens_cpu),
            num_actual_tokens=num_tokens,
            max_query_len=level.max_query_len,
            max_seq_len=level.max_seq_len,
            block_table_tensor=block_table,
            slot_mapping=slot_mapping,
            causal=True,
            seq_lens_cpu_upper_bound=level.seq_lens_cpu,
        )
        per_layer = {}
        for group in proposer.draft_attn_groups:
            metadata = group.build_metadata_for_drafting(common_attn_metadata=common, draft_index=0)
            if plan is not None:
                metadata.tree_plan = plan
            for name in group.layer_names:
                per_layer[name] = metadata
        inputs = draft_model_inputs(proposer, token_ids, level.positions, slot_mapping)
        with self.timers.measure("draft_forward"):
            return run_draft_model(proposer, inputs, per_layer)


def level_spans(tree) -> list[tuple[int, int]]:
    """Per depth 0..D of ``tree`` (a TreeSpec or LevelLayout: positions breadth-first),
    its (first, last) position."""
    ends = itertools.accumulate(tree.nodes_per_depth)
    return [(end - n, end - 1) for end, n in zip(ends, tree.nodes_per_depth)]


class _Shape:
    """What the level loop needs of one tree shape, built once per shape."""

    def __init__(self, tree: TreeSpec, device: torch.device):
        self.level_span = level_spans(tree)
        # The drafter runs every node above the deepest level (leaves are never run).
        self.last_run_node = self.level_span[tree.max_depth - 1][1]
        # Per depth: [(parents [g], kids [g, m], m, where the parents' rows are in the level,
        # the same as an index tensor)]; the first of the two is a slice (a view of q, no
        # copy) when the parents are consecutive.
        self.groups = []
        num_children = tree.num_children
        for d in range(tree.max_depth):
            first, last = self.level_span[d]
            groups = []
            for m in sorted(set(num_children[first : last + 1].tolist()) - {0}):
                parents = torch.nonzero(num_children[first : last + 1] == m).flatten() + first
                lo, hi = int(parents[0]) - first, int(parents[-1]) - first + 1
                in_level_index = (parents - first).to(device)
                in_level = slice(lo, hi) if hi - lo == len(parents) else in_level_index
                groups.append((parents.to(device), tree.children[parents, :m].to(device), m, in_level, in_level_index))
            self.groups.append(groups)
        # Per depth d >= 1: which nodes of the tree (up to the level's last) each node of the level sees.
        self.level_masks = [None] + [
            tree.ancestor_mask[first : last + 1, : last + 1].to(device) for first, last in self.level_span[1:-1]
        ]


class GreedyRows(NamedTuple):
    """Which active rows are greedy: on the device (int8, what the drafting kernel
    reads), on the host (bool), and any / all."""

    rows: torch.Tensor
    host: torch.Tensor
    any: bool
    all: bool

    def first(self, n: int) -> GreedyRows:
        """The first ``n`` rows (a level that runs the requests cut deeper only)."""
        if n == len(self.host):
            return self
        host = self.host[:n]
        return GreedyRows(self.rows[:n], host, bool(host.any()), bool(host.all()))


def softmax_into(rows: torch.Tensor, logits: torch.Tensor, temp: torch.Tensor, banned) -> torch.Tensor:
    """rows [R, W, V] float32 <- softmax(logits [R, W, V] / T) over each request's
    allowed tokens (temp [R, 1, 1]; banned [R, V] bool or None), returned."""
    if triton_reads(rows, logits):  # CUDA: one launch, three passes over the rows
        from ..core.kernels.triton_temperature_softmax import temperature_softmax

        return temperature_softmax(logits, temp.view(-1), banned, rows)
    banned = None if banned is None else banned.unsqueeze(1)
    return softmax_(_masked(rows.copy_(logits).div_(temp), banned))


def _masked(logits: torch.Tensor, banned: torch.Tensor | None) -> torch.Tensor:
    """Logits with the request's disallowed tokens at -inf (in place), q's support
    then the allowed set; ``banned`` broadcasts against ``logits``."""
    return logits if banned is None else logits.masked_fill_(banned, float("-inf"))


def _on_device(sampled_token_ids, device: torch.device) -> torch.Tensor:
    """The step's sampled tokens [B, W] (-1 padded) on ``device``: vLLM hands a device
    tensor, or lists of each request's tokens (sent up, padded, without a host sync)."""
    if torch.is_tensor(sampled_token_ids):
        return sampled_token_ids
    width = max(1, max((len(row) for row in sampled_token_ids), default=0))
    rows = np.full((len(sampled_token_ids), width), -1, dtype=np.int64)
    for i, row in enumerate(sampled_token_ids):
        rows[i, : len(row)] = row
    return upload(rows, device)
