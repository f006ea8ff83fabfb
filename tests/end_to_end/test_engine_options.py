"""Engine-wide options tree speculation sets or refuses when vLLM builds its
config: the V1 model runner (where the trees live), no full CUDA graphs (a
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


def _engine_args(target, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=target,
        max_model_len=256,
        speculative_config={"method": "univer", "model": target, "tree": "2x2"},
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


def test_explicit_v2_model_runner_is_refused(target, monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(ValueError, match="V1 model runner"):
        _engine_args(target).create_engine_config()


def test_pipeline_parallelism_is_refused_at_start_up(target):
    """Only the last stage learns the accepted path; the error says so before any worker starts."""
    with pytest.raises(ValueError, match="does not support pipeline parallelism"):
        _engine_args(target, pipeline_parallel_size=2, distributed_executor_backend="mp").create_engine_config()
