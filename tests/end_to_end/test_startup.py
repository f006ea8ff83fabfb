"""Start-up work that tree speculation adds to vLLM's engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from engine_job import BASE_KWARGS, ENV  # noqa: E402

# Runs vLLM's profile / warm-up run of the draft model (SpecDecodeBaseProposer.
# dummy_run, patched by the plugin) in a live engine and counts its forwards.
_COUNT_DRAFT_PROFILE_FORWARDS = """
import json, sys
from vllm import LLM

def profile_draft(worker):
    drafter = worker.model_runner.drafter
    forwards = []
    hook = drafter.model.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        drafter.dummy_run(num_tokens=16)
    finally:
        hook.remove()
    return len(forwards)

target, draft, tree, base = sys.argv[1:]
llm = LLM(model=target, max_model_len=256, speculative_config={"method": "univer", "model": draft, "tree": tree},
          **json.loads(base))
print("FORWARDS", llm.collective_rpc(profile_draft)[0])
"""


def _draft_profile_forwards(target: str, draft: str, tree: str) -> int:
    proc = subprocess.run(
        [sys.executable, "-c", _COUNT_DRAFT_PROFILE_FORWARDS, target, draft, tree, json.dumps(BASE_KWARGS)],
        capture_output=True,
        text=True,
        env={**os.environ, **ENV},
        timeout=600,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("FORWARDS "):
            return int(line.split()[1])
    raise RuntimeError(proc.stderr[-4000:])


def test_draft_profile_run_makes_one_forward_per_tree_level(tiny_pair):
    """vLLM profiles its draft with num_speculative_tokens forwards (every tree
    node); the tree drafter makes one per level above the leaves, and so does the
    profile run: 2x5 (62 nodes) as many as the 1x5 chain, 2x3 three fifths of it."""
    target, draft = tiny_pair
    assert [_draft_profile_forwards(target, draft, tree) for tree in ("1x5", "2x5", "2x3")] == [5, 5, 3]


# Starts one compiled engine (no enforce_eager) and reports how many AOT-compiled
# models vLLM loaded from its compile cache, and a greedy completion.
_COMPILED_START = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.compilation.counter import compilation_counter

target, draft, base = sys.argv[1:]
llm = LLM(model=target, max_model_len=256, speculative_config={"method": "univer", "model": draft, "tree": "2x2"},
          **{**json.loads(base), "enforce_eager": False})
out = llm.generate({"prompt_token_ids": [1, 5, 9, 14]}, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
print("RESULT", json.dumps({"loaded": compilation_counter.num_aot_artifacts_loaded,
                            "compiled": compilation_counter.num_aot_compiles,
                            "tokens": list(out[0].outputs[0].token_ids)}))
"""


def _compiled_start(target: str, draft: str, cache_root) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILED_START, target, draft, json.dumps(BASE_KWARGS)],
        capture_output=True,
        text=True,
        env={**os.environ, **ENV, "VLLM_CACHE_ROOT": str(cache_root)},
        timeout=900,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line.split(" ", 1)[1])
    raise RuntimeError(proc.stderr[-4000:])


def test_later_start_loads_both_compiled_models_from_the_cache(tiny_pair, tmp_path):
    """vLLM 0.32.0's CPU build saved its AOT-compiled models but failed to load
    them ('function' object has no attribute 'finalize_loading'), so every start
    compiled the target and the draft again (patch_aot_artifact_finalize_loading).
    A second start on the same cache loads both, compiles neither, and generates
    the same greedy tokens as the first."""
    target, draft = tiny_pair
    first = _compiled_start(target, draft, tmp_path)
    second = _compiled_start(target, draft, tmp_path)
    assert (first["compiled"], first["loaded"]) == (2, 0)
    assert (second["compiled"], second["loaded"]) == (0, 2)
    assert second["tokens"] == first["tokens"] and len(first["tokens"]) == 24
