#!/usr/bin/env bash
# The main job. Sets up ./.venv if needed, then shows every verifier's exact
# expected acceptance side by side on a built-in example. (Serving through
# `vllm serve --speculative-config '{"method": "univer", ...}'` replaces this
# once the vLLM integration lands; see the README.)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/setup_venv.sh"
exec "${VENV:-$repo/.venv}/bin/python" -m vllm_univer.demo "$@"
