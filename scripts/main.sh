#!/usr/bin/env bash
# The main job: serve the default real model pair (Qwen2.5-Coder 1.5B target,
# 0.5B draft) with UniVer tree speculation on 127.0.0.1, offline. Sets up
# ./.venv (CUDA or CPU vLLM build), fetches and checks the models (progress
# bars), prints the URL and a ready-to-paste openai example once the server is
# up. A second run reuses everything; Ctrl-C stops the server cleanly.
#
#   PORT (8000), TREE (auto: the depth cut of 2x5 that measures fastest, per step), VERIFIER (univer), DTYPE (bfloat16 where the hardware runs it natively, else float32), TARGET_MODEL and
#   DRAFT_MODEL (folders, instead of the default pair); extra arguments go to vllm serve.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS=test,bench bash "$repo/scripts/setup_venv.sh"
exec "${VENV:-$repo/.venv}/bin/python" "$repo/scripts/serve_default.py" "$@"
