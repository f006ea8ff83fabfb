"""Bad configs fail at engine construction with a clear message; a bad request
fails alone and the engine goes on serving."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from engine_job import run_engines  # noqa: E402
from tiny_models import build_tiny_llama  # noqa: E402

from vllm_univer.integration.plugin import check_vllm_version  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("error_models")
    target = build_tiny_llama(root / "target", vocab_size=512, seed=0)
    other_vocab = build_tiny_llama(root / "other_vocab", vocab_size=256, seed=5)
    return str(target), str(other_vocab)


def test_bad_configs_fail_at_construction_with_clear_messages(models):
    target, other_vocab = models
    bad = [
        ({"model": target, "verifier": "medusa"}, "unknown verifier 'medusa'"),
        ({"model": target, "tree": "2y5"}, "malformed tree"),
        ({"model": target, "tree": "2x7"}, "at most 128"),
        ({"model": target, "tree": "2x3", "verifier": "block"}, "single chain"),
        ({"tree": "2x3"}, "needs a draft model"),
        ({"model": other_vocab, "tree": "2x2"}, "vocab"),
    ]
    engines = [
        {
            "kwargs": {"model": target, "max_model_len": 256, "speculative_config": {"method": "univer", **spec}},
            "calls": [],
        }
        for spec, _ in bad
    ]
    engines.append(
        {
            "kwargs": {
                "model": target,
                "max_model_len": 256,
                "async_scheduling": True,
                "speculative_config": {"method": "univer", "model": target},
            },
            "calls": [],
        }
    )
    results = run_engines(engines)
    for (spec, message), result in zip(bad, results):
        assert message in result.get("error", ""), (spec, result)
    assert "synchronous scheduling" in results[-1].get("error", "")


def test_bad_request_fails_alone_and_the_engine_goes_on(models):
    target, _ = models
    good = {"temperature": 0.0, "max_tokens": 20, "ignore_eos": True}
    calls = [
        {"prompts": ["the tree"], "params": [good]},
        {"prompts": ["the tree"], "params": [{**good, "structured_outputs": {"json": "{not a schema"}}]},
        {"prompts": ["the tree"], "params": [{**good, "temperature": 1.0, "logit_bias": {"100000": 1.0}}]},
        {"prompts": ["the tree"], "params": [{**good, "temperature": 1.0, "min_p": 0.1, "logit_bias": {"7": 1.0}}]},
        {"prompts": ["the tree"], "params": [good]},
    ]
    result = run_engines(
        [
            {
                "kwargs": {
                    "model": target,
                    "max_model_len": 256,
                    "speculative_config": {"method": "univer", "model": target, "tree": "2x2"},
                },
                "calls": calls,
            }
        ]
    )[0]
    assert "error" not in result, result.get("error")
    first, bad_schema, bad_bias, min_p, last = result["calls"]
    assert "json" in bad_schema["error"].lower()  # vLLM's own validation of the schema
    assert "out-of-vocab" in bad_bias["error"]  # vLLM's own validation
    assert "error" not in min_p and len(min_p["outputs"][0]) == 20  # refused by vLLM's own speculation, not here
    assert last["outputs"] == first["outputs"] and len(first["outputs"][0]) == 20


def test_other_vllm_releases_are_refused():
    check_vllm_version("0.32.0+cpu")
    with pytest.raises(RuntimeError, match="supports vLLM 0.32.0 only"):
        check_vllm_version("0.33.0")
