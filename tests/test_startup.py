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
