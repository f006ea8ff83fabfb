"""Full CUDA graphs of the target per query length for ``tree: auto``'s cuts
(``full_graph_lengths``, ``patches.patch_full_graphs_per_tree_length``).

vLLM's dispatcher is the real one (its keys, its own dispatching); the runner's
methods are vLLM's, patched, on a runner with only what they read. What a GPU
adds, the capture and replay of each graph, runs in ``gpu_engine.sh laws``."""

from types import SimpleNamespace

import numpy as np
import pytest
from vllm.config import CompilationConfig, CUDAGraphMode
from vllm.config.compilation import CompilationMode
from vllm.forward_context import BatchDescriptor
from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_univer.integration.config import UniverConfig
from vllm_univer.integration.full_graph_lengths import FullGraphLengths, cut_query_lengths
from vllm_univer.integration.patches import patch_full_graphs_per_tree_length

MAIN = 15  # vLLM's own length for 2x3: 1 + 14 nodes


def test_lengths_of_every_cut():
    # 2x3's width cuts: the chain 1x3 (2, 3, 4 tokens) and 2x3 (3, 7, 15); 1: no speculation.
    assert cut_query_lengths(UniverConfig(tree="auto", max_tree="2x3").tree_shapes) == {1, 2, 3, 4, 7, 15}
    # With a budget, the dynamic trees' levels (1, 2, 4, 8 positions: 3, 7, 15) are candidates too.
    dynamic = UniverConfig(tree="auto", max_tree="2x3", max_nodes=14, max_depth=3, expand=2, max_children=2)
    assert cut_query_lengths(dynamic.tree_shapes) >= {1, 2, 3, 4, 7, 15}


def test_batch_sizes_and_padding():
    graphs = FullGraphLengths({1, 3, 7, MAIN}, MAIN, max_tokens=120, max_reqs=20)
    assert graphs.lengths == [1, 3, 7]  # vLLM keeps its own
    assert graphs.batch_sizes[1] == [1, 2, 4, 8, 12, 16, 20]  # every request up to max_num_seqs
    assert graphs.batch_sizes[7] == [1, 2, 4, 8, 12, 16, 17]  # 7 x 18 > 120 tokens
    assert graphs.descriptor(5 * 7, 5, 7) == BatchDescriptor(num_tokens=56, num_reqs=8, uniform=True)
    assert graphs.descriptor(16 * 7, 16, 7) == BatchDescriptor(num_tokens=112, num_reqs=16, uniform=True)
    assert graphs.descriptor(17 * 7, 17, 7) == BatchDescriptor(num_tokens=119, num_reqs=17, uniform=True)
    assert graphs.descriptor(18 * 7, 18, 7) is None  # more requests than any graph holds
    assert graphs.descriptor(20, 3, 7) is None  # not uniform: 7 + 7 + 6 tokens
    assert graphs.descriptor(2 * MAIN, 2, MAIN) is None  # vLLM's own
    descs = graphs.descriptors()
    assert [d.num_tokens for d in descs] == sorted((d.num_tokens for d in descs), reverse=True)
    assert len(descs) == 7 * 3
    assert [d.num_reqs for d in descs if d.num_tokens == 7 * d.num_reqs] == [17, 16, 12, 8, 4, 2, 1]


def _dispatcher(mode=CUDAGraphMode.FULL_AND_PIECEWISE, lengths=(1, 2, 3, 4, 7, MAIN), data_parallel=1):
    compilation = CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE,
        cudagraph_mode=mode,
        cudagraph_capture_sizes=[15, 30, 45, 60, 120],
        max_cudagraph_capture_size=120,
        splitting_ops=list(CompilationConfig._attention_ops),
    )
    config = SimpleNamespace(
        compilation_config=compilation,
        num_speculative_tokens=MAIN - 1,
        lora_config=None,
        scheduler_config=SimpleNamespace(max_num_seqs=16, max_num_batched_tokens=2048),
        parallel_config=SimpleNamespace(data_parallel_size=data_parallel),
        observability_config=SimpleNamespace(cudagraph_metrics=False),
    )
    dispatcher = CudagraphDispatcher(config)
    if lengths is not None:
        dispatcher.univer_tree_lengths = set(lengths)
    patch_full_graphs_per_tree_length()
    dispatcher.initialize_cudagraph_keys(mode, MAIN)
    return dispatcher


def test_the_target_dispatcher_gains_one_full_graph_per_cut_and_batch_size():
    dispatcher = _dispatcher()
    full = dict(dispatcher.get_capture_descs())[CUDAGraphMode.FULL]
    ours = dispatcher.univer_full_graphs.descriptors()
    assert set(ours) <= set(full) and len(set(full)) == len(full)
    vllm_own = [d for d in full if d not in set(ours)]
    assert vllm_own and all(d.num_tokens // d.num_reqs == MAIN for d in vllm_own)
    # vLLM's own dispatching is unchanged: whole trees to its graphs, the rest piecewise.
    assert dispatcher.dispatch(30, uniform_decode=True) == (
        CUDAGraphMode.FULL,
        BatchDescriptor(num_tokens=30, num_reqs=2, uniform=True),
    )
    assert dispatcher.dispatch(14, uniform_decode=False)[0] == CUDAGraphMode.PIECEWISE
    # The drafter's dispatcher (no lengths), engines without FULL decode graphs and data-parallel
    # engines (whose batches keep vLLM's dispatching) gain nothing.
    for other in (_dispatcher(lengths=None), _dispatcher(mode=CUDAGraphMode.PIECEWISE), _dispatcher(data_parallel=2)):
        assert other.univer_full_graphs is None
        full = dict(other.get_capture_descs()).get(CUDAGraphMode.FULL, [])
        assert all(d.num_tokens // d.num_reqs == MAIN for d in full)


def _runner(dispatcher, warmups=0):
    runner = GPUModelRunner.__new__(GPUModelRunner)  # vLLM's methods, what they read set below
    runner.cudagraph_dispatcher = dispatcher
    runner.vllm_config = dispatcher.vllm_config
    runner.compilation_config = dispatcher.compilation_config
    runner.compilation_config.cudagraph_num_of_warmups = warmups
    runner.lora_config = None
    runner.model_config = SimpleNamespace(is_encoder_decoder=False)
    runner.input_batch = SimpleNamespace(lora_id_to_lora_request={})
    runner.uniform_decode_query_len = MAIN
    return runner


def _determine(runner, query_lens, **kwargs):
    query_lens = np.asarray(query_lens, dtype=np.int32)
    mode, desc, ubatch, across_dp, _stats = runner._determine_batch_execution_and_padding(
        num_tokens=int(query_lens.sum()),
        num_reqs=len(query_lens),
        num_scheduled_tokens_np=query_lens,
        max_num_scheduled_tokens=int(query_lens.max()),
        **kwargs,
    )
    assert not ubatch and across_dp is None
    return mode, desc


def test_uniform_batches_of_a_cut_replay_its_full_graph():
    runner = _runner(_dispatcher())
    # 5 requests cut to 7 tokens each: padded to the 8-request graph of length 7.
    assert _determine(runner, [7] * 5) == (CUDAGraphMode.FULL, BatchDescriptor(num_tokens=56, num_reqs=8, uniform=True))
    assert _determine(runner, [1] * 3) == (CUDAGraphMode.FULL, BatchDescriptor(num_tokens=4, num_reqs=4, uniform=True))
    # vLLM decides the rest: whole trees (its graphs), mixed batches, eager runs, more requests than captured.
    assert _determine(runner, [MAIN] * 2) == (
        CUDAGraphMode.FULL,
        BatchDescriptor(num_tokens=30, num_reqs=2, uniform=True),
    )
    assert _determine(runner, [7, 7, 3])[0] == CUDAGraphMode.PIECEWISE
    assert _determine(runner, [7] * 2, force_eager=True)[0] == CUDAGraphMode.NONE
    assert _determine(runner, [7] * 2, force_uniform_decode=False)[0] == CUDAGraphMode.PIECEWISE


def test_data_parallel_batches_keep_vllms_dispatching(monkeypatch):
    """Ranks agree on one padded size (vLLM's coordination): no graph of ours."""
    import vllm.v1.worker.gpu_model_runner as runner_module

    runner = _runner(_dispatcher())  # keys of ours, as if the engine had one rank
    monkeypatch.setattr(runner.vllm_config.parallel_config, "data_parallel_size", 2)
    agreed = []

    def coordinate_batch_across_dp(**kwargs):
        agreed.append(kwargs["num_tokens_padded"])
        return False, None, kwargs["cudagraph_mode"]

    monkeypatch.setattr(runner_module, "coordinate_batch_across_dp", coordinate_batch_across_dp)
    runner.parallel_config = runner.vllm_config.parallel_config
    assert _determine(runner, [7] * 2)[0] == CUDAGraphMode.PIECEWISE and agreed == [15]


def test_each_graph_is_captured_with_dummy_batches_of_its_length():
    runner = _runner(_dispatcher())
    seen = []

    def dummy_run(num_tokens, **kwargs):
        seen.append((num_tokens, runner.uniform_decode_query_len, kwargs["cudagraph_runtime_mode"]))
        if kwargs["cudagraph_runtime_mode"] != CUDAGraphMode.NONE:  # what vLLM's dummy run dispatches
            length = runner.uniform_decode_query_len
            mode, desc = _determine(runner, [length] * (num_tokens // length), force_uniform_decode=True)
            assert (mode, desc.num_tokens) == (kwargs["cudagraph_runtime_mode"], num_tokens)

    runner._dummy_run = dummy_run
    full = dict(runner.cudagraph_dispatcher.get_capture_descs())[CUDAGraphMode.FULL]
    for desc in full:
        runner._warmup_and_capture(desc, cudagraph_runtime_mode=CUDAGraphMode.FULL)
    assert runner.uniform_decode_query_len == MAIN  # restored
    assert [(d.num_tokens, d.num_tokens // d.num_reqs) for d in full] == [(n, length) for n, length, _ in seen]
    assert {length for _, length, _ in seen} == {1, 2, 3, 4, 7, MAIN}


@pytest.mark.parametrize("length", [1, 7])
def test_capture_with_warm_up_runs_keeps_the_length(length):
    """Warm-up and capture both run dummy batches of the graph's length, without
    the draft's dummy forwards; the runner's length and drafter are restored."""
    runner = _runner(_dispatcher(), warmups=1)
    seen = []

    class Drafter:
        def dummy_run(self, *args, **kwargs):
            raise AssertionError("the draft's dummy forwards run for a graph of a cut")

    runner.drafter = Drafter()

    def dummy_run(num_tokens, **kwargs):
        seen.append(runner.uniform_decode_query_len)
        runner.drafter.dummy_run(num_tokens)  # as vLLM's dummy run does

    runner._dummy_run = dummy_run
    import torch

    sync = torch.accelerator.synchronize
    torch.accelerator.synchronize = lambda *args: None  # no accelerator here
    try:
        runner._warmup_and_capture(BatchDescriptor(num_tokens=2 * length, num_reqs=2, uniform=True), CUDAGraphMode.FULL)
    finally:
        torch.accelerator.synchronize = sync
    assert seen == [length, length] and runner.uniform_decode_query_len == MAIN
    assert "dummy_run" not in vars(runner.drafter)  # the drafter's own again
