"""Every change this package makes to vLLM, in one place, each named after what it patches.

Applied once per process by ``plugin.register`` (the ``vllm.general_plugins``
entry point), which vLLM calls in the API server, the engine core and every
worker before it validates configs or builds model runners. Each patch leaves
vLLM's behaviour unchanged unless the engine runs ``method: "univer"``, except
two fixes of vLLM 0.32.0 CPU-build bugs that every engine gains from
(``patch_cpu_expand_kernel``, ``patch_aot_artifact_finalize_loading``).
"""

from __future__ import annotations

import functools

import torch

from .config import METHOD_NAME


def _wraps_once(owner, name: str, make_wrapper) -> None:
    original = getattr(owner, name)
    if getattr(original, "__univer_patched__", False):
        return
    wrapper = functools.wraps(original)(make_wrapper(original))
    wrapper.__univer_patched__ = True
    setattr(owner, name, wrapper)


def patch_engine_args_create_speculative_config() -> None:
    """``EngineArgs.create_speculative_config``: accept ``method: "univer"``."""
    from vllm.engine.arg_utils import EngineArgs

    from .speculative_config import check_engine_options, create_univer_speculative_config

    def make(original):
        def create_speculative_config(self, target_model_config, target_parallel_config):
            spec = self.speculative_config
            if not (isinstance(spec, dict) and spec.get("method") == METHOD_NAME):
                return original(self, target_model_config, target_parallel_config)
            if self.async_scheduling:
                raise ValueError('method "univer" needs synchronous scheduling; drop --async-scheduling')
            # Trees are drafted after each step's bookkeeping, from committed tokens.
            self.async_scheduling = False
            check_engine_options(self)
            spec = {k.replace("-", "_"): v for k, v in spec.items()}
            return create_univer_speculative_config(
                spec, target_model_config=target_model_config, target_parallel_config=target_parallel_config
            )

        return create_speculative_config

    _wraps_once(EngineArgs, "create_speculative_config", make)


def patch_model_runner() -> None:
    """``GPUModelRunner`` (also the base of ``CPUModelRunner``): attach a ``TreeSpeculation``
    after construction, check the attention layers once the KV cache exists,
    rewrite tree positions after ``_prepare_inputs``, hand the tree attention plan
    to ``_build_attention_metadata``'s result, choose the step's trees once
    ``execute_model`` has launched the target forward (``tree: auto``), and draft
    trees in ``propose_draft_token_ids``. Its ``rejection_sampler`` becomes the tree verifier."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from .speculative_config import is_univer
    from .tree_speculation import TreeSpeculation

    def make_init(original):
        def __init__(self, vllm_config, device, *args, **kwargs):
            original(self, vllm_config, device, *args, **kwargs)
            self.tree_speculation = TreeSpeculation(self) if is_univer(self.speculative_config) else None

        return __init__

    def make_initialize_kv_cache(original):
        def initialize_kv_cache(self, *args, **kwargs):
            original(self, *args, **kwargs)
            if getattr(self, "tree_speculation", None) is not None:
                self.tree_speculation.check_layers()  # refuse unsupported layers at start-up, not on the first step

        return initialize_kv_cache

    def make_prepare_inputs(original):
        def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
            result = original(self, scheduler_output, num_scheduled_tokens)
            if getattr(self, "tree_speculation", None) is not None:
                _logits_indices, spec_decode_metadata, _max_num_sampled_tokens = result  # vLLM 0.32's order
                with self.tree_speculation.timers.counted("tree_plan"):
                    self.tree_speculation.prepare_tree_tokens(spec_decode_metadata)
            return result

        return _prepare_inputs

    def make_build_attention_metadata(original):
        def _build_attention_metadata(self, *args, **kwargs):
            attn_metadata, common = original(self, *args, **kwargs)
            if getattr(self, "tree_speculation", None) is not None:
                # vLLM pads the metadata (num_tokens_padded) exactly when the forward runs under a full graph.
                with self.tree_speculation.timers.counted("tree_plan"):
                    self.tree_speculation.attach_plan(
                        attn_metadata, kwargs.get("num_tokens_padded"), kwargs.get("max_query_len")
                    )
            return attn_metadata, common

        return _build_attention_metadata

    def make_execute_model(original):
        def execute_model(self, scheduler_output, *args, **kwargs):
            output = original(self, scheduler_output, *args, **kwargs)
            if (
                getattr(self, "tree_speculation", None) is not None
                and output is None
                and self.execute_model_state is not None
            ):
                self.tree_speculation.after_forward_launch()  # sampling follows in ``sample_tokens``
            return output

        return execute_model

    def make_propose(original):
        def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata, *args, **kwargs):
            if getattr(self, "tree_speculation", None) is None:
                return original(self, scheduler_output, sampled_token_ids, sampling_metadata, *args, **kwargs)
            self._draft_probs = None
            return self.tree_speculation.propose(sampled_token_ids, sampling_metadata)

        return propose_draft_token_ids

    _wraps_once(GPUModelRunner, "__init__", make_init)
    _wraps_once(GPUModelRunner, "initialize_kv_cache", make_initialize_kv_cache)
    _wraps_once(GPUModelRunner, "_prepare_inputs", make_prepare_inputs)
    _wraps_once(GPUModelRunner, "_build_attention_metadata", make_build_attention_metadata)
    _wraps_once(GPUModelRunner, "execute_model", make_execute_model)
    _wraps_once(GPUModelRunner, "propose_draft_token_ids", make_propose)


def patch_attention_forwards() -> None:
    """``CPUAttentionBackendImpl.forward``, ``FlashAttentionImpl.forward``,
    ``TritonAttentionImpl.forward``: exact tree attention for rows named by the
    metadata's ``tree_plan`` (vLLM's kernels are causal-only). vLLM's kernel still
    runs for the other rows unless the plan covers every row."""
    import importlib

    from .attention import cpu_tree_attention, cuda_tree_attention
    from .attention.tree_attention_plan import BACKENDS

    tree_rows_by_backend = {
        "cpu": cpu_tree_attention.forward_tree_rows,
        "flash_attn": cuda_tree_attention.forward_tree_rows,
        "triton_attn": cuda_tree_attention.forward_tree_rows,
    }

    def make_for(forward_tree_rows):
        def make(original):
            def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
                plan = getattr(attn_metadata, "tree_plan", None)
                if plan is None:
                    return original(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
                if not plan.covers_all_rows:
                    original(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
                forward_tree_rows(self, layer, query, key, value, kv_cache, attn_metadata, output, plan)
                return output

            return forward

        return make

    for kind, (module_name, class_name) in BACKENDS.items():
        try:
            impl_class = getattr(importlib.import_module(module_name), class_name)
        except ImportError:  # a backend this vLLM build does not ship
            continue
        _wraps_once(impl_class, "forward", make_for(tree_rows_by_backend[kind]))


def patch_vllm_config_v2_model_runner() -> None:
    """``VllmConfig._get_v2_model_runner_unsupported_features``: tree speculation
    lives in the V1 model runner (``GPUModelRunner``), which vLLM 0.32 no longer
    picks by default on CUDA; listing "univer" as unsupported by V2 makes vLLM fall
    back to V1 with its own log line."""
    from vllm.config import VllmConfig

    from .speculative_config import is_univer

    def make(original):
        def _get_v2_model_runner_unsupported_features(self):
            unsupported = original(self)
            if is_univer(self.speculative_config):
                unsupported.append(f"speculative method '{METHOD_NAME}'")
            return unsupported

        return _get_v2_model_runner_unsupported_features

    _wraps_once(VllmConfig, "_get_v2_model_runner_unsupported_features", make)


def patch_input_processor_validate_params() -> None:
    """``InputProcessor._validate_params``: refuse, per request and with a clear
    message (HTTP 400 from the server), sampling options tree verification cannot honour."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    from .sampling.request_options import unsupported_option
    from .speculative_config import is_univer

    def make(original):
        def _validate_params(self, params, *args, **kwargs):
            result = original(self, params, *args, **kwargs)
            if is_univer(self.speculative_config) and isinstance(params, SamplingParams):
                problem = unsupported_option(params, self.structured_outputs_config)
                if problem is not None:
                    from vllm.exceptions import VLLMValidationError

                    parameter, message = problem
                    raise VLLMValidationError(message, parameter=parameter)
            return result

        return _validate_params

    _wraps_once(InputProcessor, "_validate_params", make)


def patch_sampling_params_validate_spec_decode() -> None:
    """``SamplingParams._validate_spec_decode``: vLLM refuses ``min_p`` and
    ``logit_bias`` with any speculative decoding; tree verification applies both
    on every tree row (``bias_and_min_p``), so ``method: "univer"`` accepts them."""
    from vllm.sampling_params import SamplingParams

    from .speculative_config import is_univer

    def make(original):
        def _validate_spec_decode(self, speculative_config):
            if is_univer(speculative_config):
                return None
            return original(self, speculative_config)

        return _validate_spec_decode

    _wraps_once(SamplingParams, "_validate_spec_decode", make)


def patch_structured_output_manager() -> None:
    """``StructuredOutputManager.grammar_bitmask`` and ``.validate_tokens``: a tree's
    draft tokens are its nodes in breadth-first order, not a chain. Each node gets
    the bitmask of the grammar state after its own path (``tree_grammar``), and
    drafts are not cut at the first token the grammar refuses as if they were a
    chain (the grammar-masked target law gives such nodes probability 0)."""
    from vllm.v1.structured_output import StructuredOutputManager

    from .sampling.tree_grammar import TreeGrammarBitmask, tree_grammar_bitmask
    from .speculative_config import is_univer

    def tree_of(manager) -> TreeGrammarBitmask | None:
        spec = manager.vllm_config.speculative_config
        if not is_univer(spec):
            return None
        if getattr(manager, "_univer_tree_bitmask", None) is None:
            manager._univer_tree_bitmask = TreeGrammarBitmask(spec.univer.grammar_tree)
        return manager._univer_tree_bitmask

    def make_grammar_bitmask(original):
        def grammar_bitmask(self, requests, structured_output_request_ids, scheduled_spec_decode_tokens):
            tree = tree_of(self)
            if tree is None or not structured_output_request_ids:
                return original(self, requests, structured_output_request_ids, scheduled_spec_decode_tokens)
            return tree_grammar_bitmask(
                self, tree, requests, structured_output_request_ids, scheduled_spec_decode_tokens
            )

        return grammar_bitmask

    def make_validate_tokens(original):
        def validate_tokens(self, request, spec_tokens):
            if is_univer(self.vllm_config.speculative_config):  # tree drafts: never cut as a chain
                return spec_tokens
            return original(self, request, spec_tokens)

        return validate_tokens

    _wraps_once(StructuredOutputManager, "grammar_bitmask", make_grammar_bitmask)
    _wraps_once(StructuredOutputManager, "validate_tokens", make_validate_tokens)


def patch_proposer_dummy_run() -> None:
    """``SpecDecodeBaseProposer.dummy_run``: vLLM's profile / warm-up run of the
    draft model makes ``num_speculative_tokens`` forwards (its FIXME asks for the
    tree depth), which for a tree is every node: 62 forwards of
    ``max_num_batched_tokens`` tokens for 2x5, about 35 minutes of start-up on a
    2-core CPU. The tree drafter makes one forward per level above the leaves,
    ``max_depth`` in all (``TreeDrafter``), so the profile run makes that many."""
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    from .speculative_config import is_univer

    def make(original):
        def dummy_run(self, *args, **kwargs):
            spec = self.vllm_config.speculative_config
            if not is_univer(spec):
                return original(self, *args, **kwargs)
            num_nodes = self.num_speculative_tokens
            # The forward count it loops over (``TreeSizer`` times a single forward).
            self.num_speculative_tokens = getattr(self, "univer_forwards", None) or spec.univer.drafted_tree.max_depth
            try:
                return original(self, *args, **kwargs)
            finally:
                self.num_speculative_tokens = num_nodes

        return dummy_run

    _wraps_once(SpecDecodeBaseProposer, "dummy_run", make)


def patch_worker_warm_up() -> None:
    """``Worker.compile_or_warm_up_model`` (GPU) and ``CPUWorker``'s own: after
    vLLM's warm-up, ``tree: auto`` times the target's and the draft's forwards
    (``TreeSpeculation.calibrate``), so the server is calibrated before it answers.

    ``CPUWorker`` is imported on vLLM's CPU platform only: importing vLLM's CPU
    worker replaces ``torch.cuda.Event`` / ``Stream`` process-wide with no-op
    stand-ins, which on a GPU breaks Inductor's autotuning and vLLM's own sampler."""
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu_worker import Worker

    workers = [Worker]
    if current_platform.is_cpu():
        from vllm.v1.worker.cpu_worker import CPUWorker

        workers.append(CPUWorker)

    def make(original):
        def compile_or_warm_up_model(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            tree_speculation = getattr(self.model_runner, "tree_speculation", None)
            if tree_speculation is not None:
                tree_speculation.calibrate()
            return result

        return compile_or_warm_up_model

    for worker in workers:
        if "compile_or_warm_up_model" in worker.__dict__:
            _wraps_once(worker, "compile_or_warm_up_model", make)


def patch_full_graphs_per_tree_length() -> None:
    """``CudagraphDispatcher.initialize_cudagraph_keys``,
    ``GPUModelRunner._determine_batch_execution_and_padding`` and
    ``GPUModelRunner._warmup_and_capture``: FULL graphs of uniform batches for
    every query length ``tree: auto``'s cuts give (``full_graph_lengths``), beside
    vLLM's own for the whole tree, under ``"cuda_graphs": "full"``.

    The target runner's dispatcher carries the lengths (``univer_tree_lengths``,
    set by ``TreeSpeculation``; the drafter's dispatcher has none): its FULL keys
    gain the added graphs, so vLLM profiles their memory before sizing the KV
    cache and captures them with its own; each is warmed up and captured with
    vLLM's dummy batches of its length (``uniform_decode_query_len`` set for that
    call); a uniform batch of such a length is dispatched to its graph, padded to
    the next captured batch size, where vLLM's dispatcher would send it piecewise.
    Data-parallel, LoRA and encoder batches keep vLLM's dispatching."""
    from vllm.compilation.cuda_graph import CUDAGraphStat
    from vllm.config import CUDAGraphMode
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from .full_graph_lengths import FullGraphLengths, target_dummy_runs

    def make_initialize_keys(original):
        def initialize_cudagraph_keys(self, cudagraph_mode, *args, **kwargs):
            original(self, cudagraph_mode, *args, **kwargs)
            lengths = getattr(self, "univer_tree_lengths", None)
            self.univer_full_graphs = None
            full_decode = cudagraph_mode.decode_mode() == CUDAGraphMode.FULL and cudagraph_mode.separate_routine()
            # LoRA and data-parallel batches keep vLLM's dispatching: no graph of ours would replay.
            plain = self.vllm_config.lora_config is None and self.vllm_config.parallel_config.data_parallel_size == 1
            if not lengths or not full_decode or not plain:
                return
            scheduler = self.vllm_config.scheduler_config
            graphs = FullGraphLengths(
                lengths,
                self.uniform_decode_query_len,
                min(self.compilation_config.max_cudagraph_capture_size, scheduler.max_num_batched_tokens),
                scheduler.max_num_seqs,
            )
            self.univer_full_graphs = graphs
            for desc in graphs.descriptors():
                self.add_cudagraph_key(CUDAGraphMode.FULL, desc)

        return initialize_cudagraph_keys

    def make_determine(original):
        def _determine_batch_execution_and_padding(
            self, num_tokens, num_reqs, num_scheduled_tokens_np, max_num_scheduled_tokens, *args, **kwargs
        ):
            graphs = getattr(self.cudagraph_dispatcher, "univer_full_graphs", None)
            desc = None
            if (
                graphs is not None
                and kwargs.get("force_uniform_decode") is not False
                and not kwargs.get("force_eager", False)
                and not kwargs.get("force_has_lora", False)
                and not kwargs.get("num_encoder_reqs", 0)
                and self.lora_config is None
                and self.vllm_config.parallel_config.data_parallel_size == 1
            ):
                desc = graphs.descriptor(num_tokens, num_reqs, max_num_scheduled_tokens)
            if desc is None:
                return original(
                    self, num_tokens, num_reqs, num_scheduled_tokens_np, max_num_scheduled_tokens, *args, **kwargs
                )
            stats = None
            if self.vllm_config.observability_config.cudagraph_metrics:
                padding = desc.num_tokens - num_tokens
                stats = CUDAGraphStat(num_tokens, desc.num_tokens, padding, str(CUDAGraphMode.FULL))
            return CUDAGraphMode.FULL, desc, False, None, stats

        return _determine_batch_execution_and_padding

    def make_warmup_and_capture(original):
        def _warmup_and_capture(self, desc, *args, **kwargs):
            graphs = getattr(self.cudagraph_dispatcher, "univer_full_graphs", None)
            length = desc.num_tokens // desc.num_reqs if desc.uniform and desc.num_reqs else None
            if graphs is None or length not in graphs.batch_sizes:
                return original(self, desc, *args, **kwargs)
            # The draft's dummy forwards (one per tree level, eager under a FULL capture)
            # warm nothing the target's graph needs.
            with target_dummy_runs(self, length):
                return original(self, desc, *args, **kwargs)

        return _warmup_and_capture

    _wraps_once(CudagraphDispatcher, "initialize_cudagraph_keys", make_initialize_keys)
    _wraps_once(GPUModelRunner, "_determine_batch_execution_and_padding", make_determine)
    _wraps_once(GPUModelRunner, "_warmup_and_capture", make_warmup_and_capture)


def patch_cpu_expand_kernel() -> None:
    """``vllm.utils.cpu_triton_utils._expand_kernel_impl``: vLLM 0.32.0's CPU stand-in
    for its Triton expand kernel hands the C++ op an int64 copy of a float output,
    so per-token temperature / top-k / top-p come back uninitialised and vLLM's own
    speculative decoding samples garbage at temperature > 0 on CPU. Fill the
    output with ``repeat_interleave`` instead."""
    try:
        from vllm.utils import cpu_triton_utils
    except ImportError:
        return
    if not hasattr(cpu_triton_utils, "_expand_kernel_impl"):
        return

    def make(original):
        def _expand_kernel_impl(
            output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None, **kwargs
        ):
            counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
            values = input_val.to(output.dtype)
            values = torch.where(values == replace_from, torch.full_like(values, replace_to), values)
            expanded = values.repeat_interleave(counts)
            output[: expanded.numel()] = expanded

        return _expand_kernel_impl

    _wraps_once(cpu_triton_utils, "_expand_kernel_impl", make)


def patch_spec_decoding_prom() -> None:
    """``SpecDecodingProm`` (vLLM's spec-decode Prometheus metrics, in the API
    server): add the histogram of draft nodes per request per step
    (``tree_metrics``) for ``method: "univer"``."""
    from vllm.v1.spec_decode.metrics import SpecDecodingProm

    from .speculative_config import is_univer
    from .tree_metrics import TreeNodesProm

    def make_init(original):
        def __init__(self, speculative_config, labelnames, per_engine_labelvalues, *args, **kwargs):
            original(self, speculative_config, labelnames, per_engine_labelvalues, *args, **kwargs)
            self.univer_tree_nodes = None
            if is_univer(speculative_config):
                shapes = speculative_config.univer.tree_shapes
                self.univer_tree_nodes = TreeNodesProm(shapes, labelnames, per_engine_labelvalues)

        return __init__

    def make_observe(original):
        def observe(self, spec_decoding_stats, engine_idx: int = 0):
            original(self, spec_decoding_stats, engine_idx)
            if getattr(self, "univer_tree_nodes", None) is not None:
                self.univer_tree_nodes.observe(spec_decoding_stats.num_draft_tokens_per_pos, engine_idx)

        return observe

    _wraps_once(SpecDecodingProm, "__init__", make_init)
    _wraps_once(SpecDecodingProm, "observe", make_observe)


def patch_aot_artifact_finalize_loading() -> None:
    """``torch._dynamo.aot_compile_types.BundledAOTAutogradSerializableCallable``:
    vLLM 0.32.0's ``_try_load_aot_compiled_fn`` calls ``finalize_loading`` on every
    AOT-compiled model it loads from its cache, a method only vLLM's own
    ``VllmSerializableFunction`` has. The CPU build saves torch's bundled callable
    instead, so loading fails there and every start compiles both models again
    (about 40 s each on 2 cores). torch's callable is complete once deserialised:
    give it the no-op ``finalize_loading`` vLLM expects."""
    try:
        from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable
    except ImportError:
        return
    if not hasattr(BundledAOTAutogradSerializableCallable, "finalize_loading"):

        def finalize_loading(self, vllm_config) -> None:
            return None

        BundledAOTAutogradSerializableCallable.finalize_loading = finalize_loading


ALL_PATCHES = (
    patch_engine_args_create_speculative_config,
    patch_model_runner,
    patch_attention_forwards,
    patch_vllm_config_v2_model_runner,
    patch_input_processor_validate_params,
    patch_sampling_params_validate_spec_decode,
    patch_structured_output_manager,
    patch_proposer_dummy_run,
    patch_worker_warm_up,
    patch_full_graphs_per_tree_length,
    patch_cpu_expand_kernel,
    patch_spec_decoding_prom,
    patch_aot_artifact_finalize_loading,
)
