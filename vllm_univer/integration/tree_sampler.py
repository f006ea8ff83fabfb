"""Tree verification in place of vLLM's ``RejectionSampler``.

The runner calls ``sampler(metadata, draft_probs, logits, sampling_metadata)``
with, per request, the target logits of the root and of every scheduled tree
node (vLLM's ``[draft rows..., bonus row]`` layout: row i predicts the token
after node i). This turns them into exactly the distribution vLLM would sample
from, runs ``verify`` against the tree the drafter proposed for that request,
moves the accepted path's keys/values to consecutive slots (target and draft
layers) and answers in vLLM's ``[batch, D+1]`` layout padded with -1.
"""

from __future__ import annotations

import numpy as np
import torch
from vllm.logger import init_logger
from vllm.v1.outputs import SamplerOutput

from .. import verify, verify_greedy
from ..core.tree import TreeSpec
from ..core.tree_batch import LevelLayout, TreeBatch
from ..core.verifiers import scheme_for
from ..sizing.chain_estimate import chain_survival, greedy_chain_survival
from .attention.kv_compaction import accepted_path_moves, move_paged_kv
from .host_to_device import DeviceToHost, upload
from .sampling.bias_and_min_p import RequestBiasAndMinP
from .sampling.path_masks import TreePathMasks
from .sampling.target_probs import TreePenalties, probs_from_scaled, processed_logits, scaled_logits, split_greedy
from .step_buffer import StepBuffer
from .tree_state import TreeState
from .verify_graphs import VerifyGraphs

logger = init_logger(__name__)


def _processed_rows(tree_logits, transforms, temperature, probs, at_node) -> torch.Tensor:
    """vLLM's processed logits (``logprobs_mode`` processed_*) at the nodes ``at_node``
    [B, D+1] -> [B * (D+1), V] float32: the path transforms (logit_bias, penalties), and
    in sampled steps (``probs`` [B, N+1, V], the rows verified) the temperature (1 for
    greedy rows) and -inf where min_p / top-k / top-p left the token out (p = 0), as
    vLLM's rejection sampler hands them on; all-greedy steps: the transforms alone.
    Built only when a request asks for logprobs in a processed mode."""
    rows = processed_logits(tree_logits, transforms)  # a fresh float32 [B, N+1, V]
    if probs is not None:
        temp, _ = split_greedy(temperature)
        rows.div_(temp.view(-1, 1, 1)).masked_fill_(probs == 0, float("-inf"))
    index = at_node.unsqueeze(-1).expand(-1, -1, rows.shape[-1])
    return rows.gather(1, index).flatten(0, 1)


def tree_rows(first_row: np.ndarray, num_draft: np.ndarray, num_nodes: int) -> np.ndarray:
    """Rows of the root and nodes 1..N of each request in a flat batch (host arrays).

    first_row [R] (the root's row), num_draft [R] (nodes scheduled, a
    breadth-first prefix) -> int64 [R, N+1]; nodes past the scheduled prefix repeat
    the last scheduled row (the caller masks or ignores them).
    """
    return first_row[:, None] + np.minimum(np.arange(num_nodes + 1)[None, :], num_draft[:, None])


class TreeVerificationSampler:
    def __init__(self, runner, tree: TreeSpec, method: str, state: TreeState, kv_layers, timers, sizer=None):
        self.runner = runner
        self.sizer = sizer  # TreeSizer of ``tree: auto``: learns from the accepted depths
        self.tree = tree  # the configured tree (``tree: auto``: max_tree; its width cuts are shapes too)
        self.method = method
        self.scheme = scheme_for(method)
        self.state = state
        self.kv_layers = kv_layers  # callable -> list of (keys, values) cache views
        self.timers = timers
        self._cut_trees: dict[tuple[TreeSpec, int], TreeSpec] = {}
        self._nodes_through: dict[TreeSpec, np.ndarray] = {}
        self.probs_buffer = StepBuffer(runner.device)  # the target probabilities, [B, N+1, V]
        self.bias_and_min_p = RequestBiasAndMinP()
        self._pending = None  # the last verification's host-side update (``settle``)
        # ``cuda_graphs: full``: sampled steps replay their verification (``VerifyGraphs``,
        # set by ``TreeSpeculation``).
        self.verify_graphs: VerifyGraphs | None = None

    def __call__(self, metadata, draft_probs, logits: torch.Tensor, sampling_metadata) -> SamplerOutput:
        with self.timers.measure("verify"):
            return self._verify(metadata, logits, sampling_metadata)

    def _verify(self, metadata, logits: torch.Tensor, sampling_metadata) -> SamplerOutput:
        self.settle()  # a step whose drafter did not run (vLLM skips it near max_model_len)
        device = logits.device
        num_draft_list = list(metadata.num_draft_tokens)
        batch = len(num_draft_list)
        req_ids = self.runner.input_batch.req_ids[:batch]
        self.bias_and_min_p.update(req_ids, lambda r: self.runner.requests[r].sampling_params, device)
        if not any(num_draft_list) and not self.bias_and_min_p.any:
            # No request has a tree (``tree: auto`` chose no speculation, a prompt
            # step, or the scheduler left no room): sampled by vLLM's own sampler as
            # a plain engine would (one row per request, [B, 1] out), unless a request
            # sets logit_bias or min_p, which that sampler drops under speculation.
            self._restart_prompt_chunks(req_ids, num_draft_list)
            self.state.max_new_tokens = {}
            return self.runner.sampler(logits=logits, sampling_metadata=sampling_metadata)
        scheduled = np.asarray(num_draft_list, dtype=np.int64)  # host arrays in numpy: microseconds each
        # The trees of this step share one shape: the configured tree or (``tree:
        # auto``) the width cut the drafter last used. The scheduler may cut a tree
        # short (token budget, max_model_len) and ``auto`` drafts depth cuts: a
        # breadth-first prefix is verified as the shape cut to its last full level,
        # and the step works on the shape cut to the deepest level any request has
        # (no rows, no probabilities below it).
        shape = self.state.latest_tree
        keep_depth = self._depth_of_prefix(shape, scheduled)
        # What the drafter may assume before it reads this step's tokens: the path
        # and the bonus token, at most 1 + the depth each tree is verified to.
        self.state.max_new_tokens = dict(zip(req_ids, (1 + np.where(scheduled > 0, keep_depth, 0)).tolist()))
        tree = self._cut_tree(shape, max(1, int(keep_depth.max())))
        n1 = tree.num_nodes + 1
        num_draft = np.minimum(scheduled, tree.num_nodes)

        # Rows of each request's root and nodes in ``logits``; missing nodes repeat a valid row.
        rows = tree_rows(np.cumsum(scheduled + 1) - (scheduled + 1), num_draft, tree.num_nodes)
        if bool((num_draft == tree.num_nodes).all()) and logits.shape[0] == rows.size:
            tree_logits = logits.view(batch, n1, -1)  # every tree whole: rows in order, no copy
        else:
            tree_logits = logits[upload(rows, device)]  # [B, n1, V]
        temperature = sampling_metadata.temperature
        if temperature is None:  # all greedy
            temperature = torch.zeros(batch, device=device)
        raw_tree_logits = tree_logits  # the processed logprob modes recompute from it

        tokens, q, q_missing = self._trees_for(req_ids, num_draft_list, tree_logits, shape, n1)
        tokens = tokens[:, :n1]
        missing = tree.depth.numpy()[None, :] > keep_depth[:, None]  # below a request's cut
        tokens = tokens.masked_fill(upload(missing, device), -1)
        trees = self._step_trees(tree, shape, req_ids, device)  # the shape, or each request's own
        transforms = self._path_transforms(trees, tokens, sampling_metadata, batch)
        if sampling_metadata.all_greedy:
            # Argmax matching needs neither probabilities nor q: the argmax of the
            # processed logits, as vLLM's greedy sampler takes it.
            if transforms:
                tree_logits = processed_logits(
                    tree_logits, transforms, out=self.probs_buffer.get(tuple(tree_logits.shape))
                )
            argmax = tree_logits.argmax(-1)
            if self.verify_graphs is not None:
                result = self.verify_graphs.verify_greedy(trees, tokens, argmax)
            else:
                result = verify_greedy(trees, tokens, argmax)
            rows_for_chain = None
        else:
            result, rows_for_chain = self._verify_sampled(
                trees, tokens, q, q_missing, tree_logits, temperature, transforms, sampling_metadata, batch
            )
        end = result.end_node
        # vLLM's layout: [B, D+1] of the configured tree, -1 padded.
        output = result.output_token_ids
        if output.shape[1] < self.tree.max_depth + 1:  # a shallower cut or shape
            output = torch.nn.functional.pad(output, (0, self.tree.max_depth + 1 - output.shape[1]), value=-1)

        path = self._accepted_path(trees, end)
        with self.timers.measure("kv_moves"):
            self._keep_accepted_kv(batch, path)
        chain = self._chain_survival(shape, tree, tokens, path, rows_for_chain)
        self._defer_draft_kv_len(req_ids, num_draft_list, keep_depth, trees.on(device).depth[end], shape, chain)
        logprobs = None
        if sampling_metadata.max_num_logprobs is not None:
            at_node = torch.cat([torch.zeros_like(path[:, :1]), path], 1).clamp(min=0)  # [B, D+1]
            if self.runner.sampler.logprobs_mode.startswith("processed"):
                probs = None if rows_for_chain is None else rows_for_chain[0]
                values = _processed_rows(raw_tree_logits, transforms, temperature, probs, at_node)
            else:
                values = logits[upload(rows, device).gather(1, at_node).flatten()].float()
            logprobs = self._logprobs(values, output, sampling_metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=output.to(torch.int32), logprobs_tensors=logprobs)

    def _nodes_through_depth(self, shape: TreeSpec) -> np.ndarray:
        """[D+1]: nodes of ``shape`` at depth <= d, root included (built once per shape)."""
        if shape not in self._nodes_through:
            self._nodes_through[shape] = np.cumsum(shape.nodes_per_depth)
        return self._nodes_through[shape]

    def _depth_of_prefix(self, shape: TreeSpec, num_draft: np.ndarray) -> np.ndarray:
        """int64 [R] scheduled nodes of ``shape`` (breadth-first prefixes) -> [R] the
        depth of the shape they fill completely (0: not even depth 1)."""
        return np.searchsorted(self._nodes_through_depth(shape), num_draft + 1, side="right") - 1

    def _cut_tree(self, shape: TreeSpec | LevelLayout, depth: int) -> TreeSpec | LevelLayout:
        """``shape`` cut to ``depth`` (a breadth-first prefix: node ids unchanged)."""
        if depth >= shape.max_depth:
            return shape
        if (shape, depth) not in self._cut_trees:  # built once per shape and depth (their tables too)
            if isinstance(shape, LevelLayout):
                self._cut_trees[shape, depth] = shape.cut(depth)
            else:
                self._cut_trees[shape, depth] = TreeSpec(shape.paths[: int(self._nodes_through_depth(shape)[depth])])
        return self._cut_trees[shape, depth]

    def _step_trees(self, tree, shape, req_ids: list[str], device) -> TreeSpec | TreeBatch:
        """What this step verifies on: ``tree`` (one shape for the batch), or for
        context-aware trees (``tree`` a LevelLayout, a cut of ``shape``) each
        request's own parents on those levels (``TreeBatch``)."""
        if not isinstance(tree, LevelLayout):
            return tree
        return self.state.step_trees(req_ids, shape, device).cut(tree.max_depth)

    def _accepted_path(self, trees: TreeSpec | TreeBatch, end: torch.Tensor) -> torch.Tensor:
        """[B, D] (D: the configured tree's depth): the accepted nodes at depth 1 .. D, -1 past the end."""
        path = trees.on(end.device).ancestors_of(end)
        missing = self.tree.max_depth - path.shape[1]  # a shallower cut or shape
        return torch.nn.functional.pad(path, (0, missing), value=-1) if missing else path

    def _verify_sampled(
        self, tree, tokens, q, q_missing, tree_logits, temperature, transforms, sampling_metadata, batch: int
    ):
        with self.timers.measure("target_probs"):
            out = self.probs_buffer.get(tuple(tree_logits.shape))
            scaled, greedy = scaled_logits(tree_logits, temperature, transforms, out)
        if self._replayable(tree, scaled, q, q_missing, sampling_metadata, batch):
            with self.timers.measure("verifier"):
                replayed = self.verify_graphs.verify(
                    tree,
                    tokens,
                    scaled,
                    q,
                    greedy,
                    sampling_metadata.top_k,
                    sampling_metadata.top_p,
                    self.bias_and_min_p.min_p,
                )
            if replayed is not None:
                result, p = replayed
                return result, (p, q, greedy)
        with self.timers.measure("target_probs"):
            p = probs_from_scaled(scaled, sampling_metadata.top_k, sampling_metadata.top_p, self.bias_and_min_p.min_p)
        # Trees drafted in an all-greedy step have no q; they belong to greedy
        # requests, whose outcome is argmax matching, so any valid rows will do.
        if q is None:
            q = p
        elif q_missing is not None:
            q = torch.where(q_missing.view(-1, 1, 1), p, q)
        with self.timers.measure("verifier"):
            result = verify(self.method, tree, tokens, p, q, greedy=greedy, validate=False)
        # Seeded requests draw from their own generator, so their outputs do not
        # depend on the rest of the batch.
        for row, generator in sampling_metadata.generators.items():
            if row >= batch:
                continue
            one = verify(
                self.method,
                tree.take(row, row + 1) if isinstance(tree, TreeBatch) else tree,
                tokens[row : row + 1],
                p[row : row + 1],
                q[row : row + 1],
                generator=generator,
                greedy=greedy[row : row + 1],
                validate=False,
            )
            result.output_token_ids[row], result.end_node[row] = one.output_token_ids[0], one.end_node[0]
        return result, (p, q, greedy)

    def _replayable(self, tree, scaled, q, q_missing, sampling_metadata, batch: int) -> bool:
        """Whether this step's verification may replay a graph (``verify_graphs``): the
        scaled logits in the kept buffer (not a fresh one past its size), q for every
        tree, no seeded request (its own generator, which a graph cannot advance);
        path transforms were applied before (``scaled_logits``)."""
        return (
            self.verify_graphs is not None
            and self.probs_buffer.holds(scaled)
            and q is not None
            and q_missing is None
            and not any(row < batch for row in sampling_metadata.generators)
        )

    def _chain_survival(self, shape: TreeSpec, tree: TreeSpec, tokens, path, rows) -> torch.Tensor | None:
        """``tree: auto`` while a wider shape than the chain runs: [B, D] estimates of
        what the chain would have accepted on this step's trees (``chain_estimate``),
        so that its acceptance is known without drafting it; else None. ``rows``:
        (p, q, greedy) of a sampled step, None in an all-greedy one."""
        if self.sizer is None or not self.sizer.estimates_chain(shape):
            return None
        survival = greedy_chain_survival(tree, path)
        if rows is not None:
            p, q, greedy = rows
            sampled = chain_survival(tree, self.scheme, tokens, p, q).to(survival.dtype)
            survival = torch.where(greedy.unsqueeze(1), survival, sampled)
        return survival

    def _path_transforms(self, trees, tokens, sampling_metadata, batch: int) -> list:
        """vLLM's logits transforms that depend on the text a row continues, in vLLM's
        order. trees: the step's TreeSpec or TreeBatch (per-request shapes)."""
        tables = trees.on(tokens.device)
        masks, penalties = TreePathMasks.needed(sampling_metadata), not sampling_metadata.no_penalties
        paths = tables.token_paths(tokens) if masks or penalties else None
        transforms = []
        if masks:
            transforms.append(TreePathMasks(paths, tables.depth, sampling_metadata, batch))
        logit_bias = self.bias_and_min_p.logit_bias()
        if logit_bias is not None:
            transforms.append(logit_bias)
        if penalties:
            transforms.append(TreePenalties(paths, sampling_metadata, batch))
        return transforms

    def _logprobs(self, rows: torch.Tensor, output: torch.Tensor, num_logprobs: int):
        """The target's log-probabilities (or logits) of every output token in the
        engine's ``logprobs_mode``: output j of a request was sampled at the path's node
        of depth j (the root for j = 0); ``rows`` [B * (D+1), V] float32 are those
        nodes' raw logits or (processed modes, ``_processed_rows``) what the token was
        sampled from."""
        sampler = self.runner.sampler
        values = rows if sampler.logprobs_mode.endswith("logits") else sampler.compute_logprobs(rows)
        # Padding (-1) entries are dropped by vLLM's parse_output; any valid id will do here.
        return sampler.gather_logprobs(values, num_logprobs, output.flatten().clamp(min=0))

    def _trees_for(self, req_ids: list[str], num_draft: list[int], like: torch.Tensor, shape: TreeSpec, n1: int):
        """Tokens [B, N+1], q [B, n1, V] (or None) and the rows drafted without q,
        for the trees of ``shape`` (a tree of another shape: none, the root alone)."""
        tokens, q, _, q_missing = self.state.gather(req_ids, shape, n1)
        orphans = [r for r, n in zip(req_ids, num_draft) if n > 0 and r not in self.state.trees]
        if orphans:
            # Should not happen; rejecting every draft (Y ~ p at the root) stays lossless.
            logger.warning("tree speculation: no drafted tree for the scheduled drafts of %s", orphans)
        if tokens is None:  # no trees at all: q is never read
            return torch.full(like.shape[:2], -1, dtype=torch.long, device=like.device), None, None
        return tokens, q, q_missing

    def _keep_accepted_kv(self, batch: int, path: torch.Tensor) -> None:
        """Move each accepted path ([B, D] nodes) to consecutive slots in every layer's cache."""
        input_batch = self.runner.input_batch
        context_lens = torch.from_numpy(input_batch.num_computed_tokens_cpu[:batch].astype(np.int64))
        caches = [half for layer in self.kv_layers() for half in layer]
        if not caches:  # vLLM's profile run: no cache allocated yet, nothing to keep
            return
        device = path.device
        fused = _fused_kv_moves(caches)
        if fused is not None:  # CUDA: one launch per cache shape, the paths never read on the host
            block_table = upload(input_batch.block_table[0].get_cpu_tensor()[:batch], device)
            fused.move_accepted_kv(caches, block_table, upload(context_lens, device), path)
            return
        request, src, dst = accepted_path_moves(context_lens, path.cpu())
        if request.numel() == 0:
            return
        # Uploaded after the early return, not above the branch: no copy in a step with no moves.
        block_table = upload(input_batch.block_table[0].get_cpu_tensor()[:batch], device)
        request, src, dst = (upload(t, device) for t in (request, src, dst))
        move_paged_kv(caches, block_table, request, src, dst)

    def settle(self) -> None:
        """Apply what the last verification left to the host (``_defer_draft_kv_len``):
        called once the drafter has launched its forwards (it waits for the device),
        before the drafter records the draft cache's new lengths."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending()

    def _defer_draft_kv_len(
        self, req_ids, num_draft, keep_depth: np.ndarray, accepted: torch.Tensor, shape: TreeSpec, chain=None
    ) -> None:
        """The draft cache now holds the context, the root and the accepted nodes
        above the path's end node (each had a child, so the drafter ran it; the end
        node itself it may not have: a leaf, or a context-aware tree's node not expanded).
        ``accepted``: [B] depth of each end node, on the device; ``chain``: [B, D]
        the chain's estimated acceptance, or None (``_chain_survival``).

        Both reach the host in one copy, read at ``settle()``: reading them here
        would stall the device in mid-step while the host launches the rest."""
        both = accepted.unsqueeze(1) if chain is None else torch.cat([accepted.unsqueeze(1).to(chain.dtype), chain], 1)
        copy = DeviceToHost(both)
        computed = self.runner.input_batch.num_computed_tokens_cpu[: len(req_ids)].copy()
        self._restart_prompt_chunks(req_ids, num_draft)

        def update() -> None:
            host = copy.numpy()
            accepted = host[:, 0].astype(np.int64)
            chain_host = None if chain is None else host[:, 1:]
            if self.sizer is not None and len(req_ids) == len(num_draft):  # not vLLM's profile run (no requests)
                self._defer_learning(req_ids, num_draft, keep_depth, accepted, shape, chain_host)
            for i, (req_id, n, k) in enumerate(zip(req_ids, num_draft, accepted.tolist())):
                if n > 0:
                    self.state.draft_kv_len[req_id] = int(computed[i]) + max(k, 1)

        self._pending = update

    def _defer_learning(self, req_ids, num_draft, keep_depth, accepted, shape: TreeSpec, chain) -> None:
        """What the sizer learns from this step's verified trees, handed over to be
        learnt once the drafter has launched its forwards (``TreeSizer.defer``): the
        host is then free while the device drafts. Copies, not views of the batch."""
        drafted = np.asarray(num_draft) > 0
        temperature = self.runner.input_batch.temperature_cpu[: len(req_ids)][drafted]
        keep_depth, accepted = keep_depth[drafted], accepted[drafted]
        chain = None if chain is None else chain[drafted]
        drafted_ids = [r for r, d in zip(req_ids, drafted) if d]
        sizer = self.sizer

        def learn() -> None:
            sizer.observe_acceptance(shape, temperature, keep_depth, accepted, drafted_ids)
            if chain is not None:
                sizer.observe_chain(temperature, keep_depth, chain)

        sizer.defer(learn)

    def _restart_prompt_chunks(self, req_ids, num_draft) -> None:
        """Requests that ran a prompt chunk this step (new or resumed) are drafted from the start."""
        query_start = self.runner.query_start_loc.np
        for i, (req_id, n) in enumerate(zip(req_ids, num_draft)):
            if n == 0 and query_start[i + 1] - query_start[i] > 1:
                self.state.draft_kv_len[req_id] = 0


def _fused_kv_moves(caches: list[torch.Tensor]):
    """``kernels.triton_kv_moves`` where it can move these caches (CUDA, Triton), else None.
    A cache may be a tensor-like view (``kv_cache_views.TiledPagedCache``, vLLM's amx
    layout on CPU): only its ``device`` is read here."""
    if caches[0].device.type != "cuda":
        return None
    try:
        from .attention import triton_kv_moves
    except ImportError:
        return None
    return triton_kv_moves if triton_kv_moves.fused_kv_moves_apply(caches) else None
