"""Tree speculation attached to one vLLM model runner (``runner.tree_speculation``).

Owns the per-request tree state, the tree drafter and the tree verifier, and
does the two things the runner's verification forward needs beyond vLLM's chain
path: RoPE positions L + depth for tree tokens (after vLLM has computed their
consecutive cache slots) and the tree attention plan for their rows.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch

from ..core.tree import TreeSpec
from ..core.tree_batch import LevelLayout
from .attention.kv_cache_views import check_cpu_isa, layer_kv_views
from .attention.tree_attention_plan import TreeAttentionPlan, backend_kind, check_layer_supported
from .attention.tree_graph_plans import TreeGraphPlans, uniform_batch_plan
from .draft_level_graphs import Capture, DraftLevelGraphs, cuda_graph_capture
from .dynamic_tree_drafter import DynamicTreeDrafter
from .full_graph_lengths import cut_query_lengths
from .host_to_device import upload, upload_packed
from .sampling.request_options import has_structured_output
from .step_buffer import StepBuffer
from .timers import StepTimers
from .tree_drafter import TreeDrafter
from .tree_sampler import TreeVerificationSampler, tree_rows
from .tree_sizer import TreeSizer
from .tree_state import TreeState
from .verify_graphs import VerifyGraphs


class TreeSpeculation:
    def __init__(self, runner):
        config = runner.speculative_config.univer
        if runner.uses_mrope:
            raise NotImplementedError("tree speculation does not support M-RoPE models")
        _refuse_custom_logits_processors(runner.input_batch.logitsprocs)
        self.runner = runner
        self.tree = config.drafted_tree  # a TreeSpec, or (tree: dynamic) the LevelLayout of per-request trees
        self.state = TreeState(latest_tree=self.tree, reordered_q=StepBuffer(runner.device))
        self.timers = StepTimers(runner.device)
        if config.dynamic or config.auto_dynamic:  # tree auto's candidates: dynamic trees and static cuts
            self.drafter = DynamicTreeDrafter(
                runner, runner.drafter, config.dynamic_budget, self.state, self.timers, tree=self.tree
            )
        else:
            self.drafter = TreeDrafter(runner, runner.drafter, self.tree, config.scheme, self.state, self.timers)
        # tree: dynamic drafts this static tree in steps with a structured-output request.
        self._grammar_tree = config.grammar_tree if config.dynamic else None
        full_graphs = config.cuda_graphs == "full" and torch.device(runner.device).type == "cuda"
        self.sizer = None
        if config.auto:  # under full graphs a step's requests share one cut: its uniform batch replays a graph
            self.sizer = TreeSizer(runner, config.tree_shapes, self.drafter, one_cut_per_step=full_graphs)
        self.sampler = TreeVerificationSampler(
            runner, self.tree, config.verifier, self.state, self.kv_layers, self.timers, self.sizer
        )
        runner.rejection_sampler = self.sampler
        self._pending_plan: TreeAttentionPlan | None = None
        self._kv_views = None
        # Full CUDA graphs of batches of whole trees (opt-in; CUDA only).
        self.graph_plans = None
        self.full_graph_forwards: Counter[int] = Counter()  # real batches under full graphs, per query length
        self._graph_batch: np.ndarray | None = None  # cached tokens per request of the batch being prepared
        if full_graphs:
            self.use_full_graph_plans()
            capture = cuda_graph_capture()
            self.use_draft_level_graphs(capture)
            self.use_verify_graphs(capture)

    def use_full_graph_plans(self) -> None:
        """Plan the target's tree rows in full CUDA graphs' buffers (``TreeGraphPlans``)
        for uniform batches of whole trees and, with ``tree: auto``, of every cut's
        length, whose graphs the runner's dispatcher then adds beside vLLM's
        (``full_graph_lengths``; the CPU tests call this to emulate the dispatch)."""
        runner, config = self.runner, self.runner.speculative_config.univer
        query_lens = {self.tree.num_nodes + 1}
        if self.sizer is not None:
            runner.cudagraph_dispatcher.univer_tree_lengths = cut_query_lengths(config.tree_shapes)
            query_lens |= runner.cudagraph_dispatcher.univer_tree_lengths
        self.graph_plans = TreeGraphPlans(query_lens, runner.max_model_len)

    def use_draft_level_graphs(self, capture: Capture) -> None:
        """Replay the drafter's uniform level forwards from graphs made by ``capture``
        (``DraftLevelGraphs``; the CPU tests pass ``rerun_capture``)."""
        runner = self.runner
        max_reqs = runner.scheduler_config.max_num_seqs
        self.drafter.level_graphs = DraftLevelGraphs(runner.drafter, runner.max_model_len, max_reqs, capture)

    def use_verify_graphs(self, capture: Capture) -> None:
        """Replay sampled steps' verification from graphs made by ``capture``
        (``VerifyGraphs``). The graphs read the target probabilities' and the draft
        rows' buffers where they lie (the rows reordered for a batch in another order
        too): kept from step to step (on CUDA a fresh tensor per step is the default)."""
        self.sampler.verify_graphs = VerifyGraphs(self.sampler.method, capture)
        self.sampler.probs_buffer.keep = self.drafter.q_rows.keep = self.state.reordered_q.keep = True

    # ------------------------------------------------------------ KV caches
    def attention_layers(self):
        """Every attention layer of the target and the draft, each cache once."""
        from vllm.model_executor.layers.attention import Attention

        runner = self.runner
        if len(runner.kv_cache_config.kv_cache_groups) != 1:
            raise NotImplementedError("tree speculation needs a single KV cache group (no hybrid models)")
        seen = set()
        for layer in runner.compilation_config.static_forward_context.values():
            if not isinstance(layer, Attention):
                continue
            cache = layer.kv_cache
            if not isinstance(cache, torch.Tensor) or cache.numel() == 0 or cache.data_ptr() in seen:
                continue
            seen.add(cache.data_ptr())
            yield layer

    def check_layers(self) -> None:
        """Refuse attention backends and layer features tree attention does not support."""
        for layer in self.attention_layers():
            check_layer_supported(layer.impl)
            if backend_kind(layer.impl) == "cpu":
                check_cpu_isa(getattr(layer, "isa", None))

    def kv_layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(keys, values) views of every attention layer's cache, target and draft;
        none before vLLM allocates the caches (its profile run samples too)."""
        if not hasattr(self.runner, "kv_cache_config"):
            return []
        if self._kv_views is None:
            views = []
            for layer in self.attention_layers():  # already checked by ``check_layers`` at start-up
                views.append(layer_kv_views(layer.impl, layer.kv_cache, getattr(layer, "isa", None)))
            self._kv_views = views
        return self._kv_views

    # ------------------------------------------------ verification forward
    def prepare_tree_tokens(self, spec_decode_metadata) -> None:
        """Rewrite tree tokens' positions to L + depth and plan their attention.

        Called right after the runner's ``_prepare_inputs``: slots are already
        computed from the consecutive positions; the model reads ``runner.positions``.
        """
        self._pending_plan = None
        if self.graph_plans is not None:  # a real batch (not a dummy forward): what a full graph's plan needs
            computed = self.runner.input_batch.num_computed_tokens_cpu[: self.runner.input_batch.num_reqs]
            self._graph_batch = computed.astype(np.int64)
        if spec_decode_metadata is None:
            return
        # Host arrays in numpy: a few microseconds per operation where small CPU
        # tensors cost ten, and the device waits for this before the target forward.
        num_draft = np.asarray(spec_decode_metadata.num_draft_tokens, dtype=np.int64)
        tree_reqs = np.nonzero(num_draft > 0)[0]
        if tree_reqs.size == 0:
            return
        runner = self.runner
        device = runner.positions.device
        batch = num_draft.shape[0]
        query_start = runner.query_start_loc.np[: batch + 1].astype(np.int64)
        computed = runner.input_batch.num_computed_tokens_cpu[:batch].astype(np.int64)
        # The shape of the trees drafted for this step (``tree: auto`` switches among
        # width cuts). A request skipped while the shape changed has more rows than
        # this shape has nodes: its tree is not verified (``TreeState.gather``), its
        # rows past the shape's are left to vLLM's causal attention.
        tree = self.state.latest_tree
        if tree.is_chain:
            # A chain's node at depth k sits at position L + k, where vLLM put it, and
            # sees what causal attention shows it: vLLM's own kernel, no tree rows.
            return
        n = np.minimum(num_draft[tree_reqs], tree.num_nodes)
        # Trees are breadth-first prefixes (depth cuts, scheduler cuts): attention
        # runs over the longest one, not the whole shape (a 2x5 cut to depth 1 has
        # 3 rows of 63).
        nodes = int(n.max())
        row_valid = np.arange(nodes + 1)[None, :] <= n[:, None]  # [R, nodes+1]
        rows = tree_rows(query_start[tree_reqs], n, nodes)
        context = computed[tree_reqs]
        positions = context[:, None] + tree.depth.numpy()[None, : nodes + 1]
        # The plan's index tensors reach the device in one copy (two with the masks).
        query_rows, valid_rows, valid_positions, request_index, context_lens = upload_packed(
            [rows, rows[row_valid], positions[row_valid], tree_reqs, context], device, torch.int64
        )
        if isinstance(tree, LevelLayout):  # context-aware trees: each request's own mask, built on the device
            # The whole batch's trees, as the verifier reads them after this forward.
            trees = self.state.step_trees(runner.input_batch.req_ids[:batch], tree, device)
            (row_valid_dev,) = upload_packed([row_valid], device, torch.bool)
            mask = trees.ancestor_mask[request_index, : nodes + 1, : nodes + 1]
        else:
            mask = tree.ancestor_mask[: nodes + 1, : nodes + 1]
            row_valid_dev, mask = upload_packed([row_valid, mask], device, torch.bool)
        runner.positions[valid_rows] = valid_positions.to(runner.positions.dtype)
        self._pending_plan = TreeAttentionPlan(
            query_rows=query_rows,
            row_valid=row_valid_dev,
            request_index=request_index,
            context_lens=context_lens,
            mask=mask,
            # A batch of tree decodes only: vLLM's causal kernel would compute rows we overwrite.
            covers_all_rows=int(query_start[batch]) == int((n + 1).sum()),
            max_context_len=int(context.max()),
        )

    def attach_plan(self, attn_metadata, num_tokens_padded: int | None = None, max_query_len: int | None = None):
        """Hand the pending plan to the attention metadata of this forward.

        num_tokens_padded: set when vLLM runs the forward under a full CUDA graph
        (its dummy forwards too: warm-up and capture), padded to that many tokens;
        max_query_len: its most query tokens of one request. Such a forward's
        layers read the captured size's buffers, this step's plan written in."""
        plan, self._pending_plan = self._pending_plan, None
        batch, self._graph_batch = self._graph_batch, None
        if self.graph_plans is not None and num_tokens_padded is not None and isinstance(attn_metadata, dict):
            plan = self._full_graph_plan(plan, batch, num_tokens_padded, max_query_len, attn_metadata)
        if plan is None:
            return
        if not isinstance(attn_metadata, dict):
            raise NotImplementedError("tree speculation does not support micro-batching (ubatches)")
        for metadata in {id(m): m for m in attn_metadata.values()}.values():
            metadata.tree_plan = plan

    def _full_graph_plan(self, plan, computed, num_tokens_padded: int, max_query_len: int, attn_metadata):
        """A forward under a full CUDA graph: a uniform batch of trees (N + 1 tokens
        per request, or with ``tree: auto`` a cut's length) reads the captured
        graph's buffers, every request's rows written in (``computed``: their cached
        tokens; None for vLLM's dummy forwards); any other batch carries no tree
        (vLLM dispatches mixed batches to piecewise graphs)."""
        if max_query_len not in self.graph_plans.query_lens:
            if plan is not None:
                raise RuntimeError(
                    f"a full CUDA graph forward of up to {max_query_len} tokens per request carries trees; "
                    f"graphs of trees have {sorted(self.graph_plans.query_lens)} positions"
                )
            return None
        if computed is not None:
            context = upload(computed, self.runner.device)
            plan = uniform_batch_plan(plan, context, int(computed.max()), max_query_len)
            self.full_graph_forwards[max_query_len] += 1
        table = next(iter(attn_metadata.values())).block_table
        return self.graph_plans.for_forward(num_tokens_padded, max_query_len, plan, table)

    def calibrate(self) -> None:
        """After vLLM's warm-up: time the forwards ``tree: auto`` chooses with."""
        if self.sizer is not None:
            self.sizer.calibrate()

    def after_forward_launch(self) -> None:
        """The target forward of this step is launched (on a GPU still running): host
        work that needs nothing from its result goes here."""
        if self.sizer is not None:
            self.sizer.choose_ahead()

    def propose(self, sampled_token_ids, sampling_metadata):
        shape, depth, catch_up = None, None, None
        if self.sizer is not None:
            self.sizer.step_started()
            batch = self.runner.input_batch.num_reqs
            shape, depth = self.sizer.choose(batch)
            catch_up = self.sizer.catch_up
        elif self._grammar_tree is not None:
            shape = self._dynamic_or_grammar_tree()
        with self.timers.measure("draft"):
            return self.drafter.propose(
                sampled_token_ids, sampling_metadata, depth, shape, self._after_draft_launch, catch_up
            )

    def _dynamic_or_grammar_tree(self) -> TreeSpec | LevelLayout:
        """``tree: dynamic``'s shape for this step: each request's own tree on the
        levels, unless a request asks for structured outputs. vLLM's scheduler
        builds that request's grammar rows from its draft tokens and one shape it
        knows, so such a step drafts the static tree on the same levels (a choice
        made before any draw: the step stays lossless)."""
        batch = self.runner.input_batch
        if has_structured_output(self.runner.requests, batch.req_ids[: batch.num_reqs]):
            return self._grammar_tree
        return self.tree

    def _after_draft_launch(self) -> None:
        """Every draft forward is launched (on a GPU queued behind the verification):
        now the host may wait for what the verification left it, the draft cache's
        lengths and what the sizer learns from the verified trees."""
        self.sampler.settle()
        if self.sizer is not None:
            self.sizer.draft_launched()
            self.sizer.learn_deferred()


def _refuse_custom_logits_processors(logitsprocs) -> None:
    """vLLM's built-in processors are honoured on every tree row (min_tokens per
    path; min_p and logit_bias by ``bias_and_min_p``, as vLLM builds no processor
    for them under speculation); a custom processor's state follows one text,
    not every path of a tree."""
    from vllm.v1.sample.logits_processor.builtin import (
        LogitBiasLogitsProcessor,
        MinPLogitsProcessor,
        MinTokensLogitsProcessor,
    )

    builtin = (LogitBiasLogitsProcessor, MinPLogitsProcessor, MinTokensLogitsProcessor)
    custom = sorted({type(p).__name__ for p in logitsprocs.all if not isinstance(p, builtin)})
    if custom:
        raise NotImplementedError(
            f"tree speculation (method 'univer') cannot apply custom logits processors per tree path "
            f"({', '.join(custom)}); start the engine without --logits-processors"
        )
