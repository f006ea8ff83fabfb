"""Engine-wide options tree speculation sets or refuses when vLLM builds its
config: the V1 model runner (where the trees live), no full CUDA graphs unless
asked for (``"cuda_graphs": "full"``: batches of whole trees only; by default a
replayed attention call would not see the step's tree plan) and no pipeline
parallelism."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from tiny_models import build_tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from vllm_univer.integration.plugin import register

    register()
    return str(build_tiny_llama(tmp_path_factory.mktemp("options") / "target"))


def _engine_args(target, spec=None, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=target,
        max_model_len=256,
        speculative_config={"method": "univer", "model": target, "tree": "2x2", **(spec or {})},
        **kwargs,
    )


def test_univer_keeps_the_v1_model_runner_and_piecewise_graphs(target):
    from vllm.config import CUDAGraphMode

    args = _engine_args(target)
    config = args.create_engine_config()
    assert "speculative method 'univer'" in config._get_v2_model_runner_unsupported_features()
    assert not config.use_v2_model_runner
    # Unset cudagraph mode became PIECEWISE before vLLM resolved it (the CPU build then turns graphs off).
    assert args.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    assert not config.compilation_config.cudagraph_mode.has_full_cudagraphs()


def test_other_methods_keep_vllm_defaults(target):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=target,
        max_model_len=256,
        speculative_config={"method": "draft_model", "model": target, "num_speculative_tokens": 2},
    )
    config = args.create_engine_config()
    assert not any("univer" in f for f in config._get_v2_model_runner_unsupported_features())
    assert args.compilation_config.cudagraph_mode is None


@pytest.mark.parametrize("mode", ["FULL", "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"])
def test_full_cuda_graphs_are_refused(target, mode):
    with pytest.raises(ValueError, match="outside CUDA graphs"):
        _engine_args(target, compilation_config={"cudagraph_mode": mode}).create_engine_config()


def test_full_graphs_for_whole_trees_are_opt_in(target):
    """``"cuda_graphs": "full"``: unset mode becomes FULL_AND_PIECEWISE (batches of whole
    trees replay one graph, mixed batches piecewise); the config carries the switch."""
    from vllm.config import CUDAGraphMode

    args = _engine_args(target, {"cuda_graphs": "full"})
    config = args.create_engine_config()
    assert args.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
    assert config.speculative_config.univer.cuda_graphs == "full"
    for mode in ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"):
        explicit = _engine_args(target, {"cuda_graphs": "full"}, compilation_config={"cudagraph_mode": mode})
        explicit.create_engine_config()
        assert explicit.compilation_config.cudagraph_mode == CUDAGraphMode[mode]


def test_full_graphs_of_mixed_batches_are_refused(target):
    with pytest.raises(ValueError, match="captures batches of whole trees only"):
        _engine_args(
            target, {"cuda_graphs": "full"}, compilation_config={"cudagraph_mode": "FULL"}
        ).create_engine_config()
    with pytest.raises(ValueError, match="cuda_graphs"):
        _engine_args(target, {"cuda_graphs": "whole"}).create_engine_config()


def test_explicit_v2_model_runner_is_refused(target, monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(ValueError, match="V1 model runner"):
        _engine_args(target).create_engine_config()


def test_pipeline_parallelism_is_refused_at_start_up(target):
    """Only the last stage learns the accepted path; the error says so before any worker starts."""
    with pytest.raises(ValueError, match="does not support pipeline parallelism"):
        _engine_args(target, pipeline_parallel_size=2, distributed_executor_backend="mp").create_engine_config()
