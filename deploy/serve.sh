#!/bin/sh
# Container entry point: `vllm serve` with UniVer tree speculation, configured by
# environment variables; extra arguments go to vllm serve (e.g. --tensor-parallel-size 2).
#   TARGET_MODEL, DRAFT_MODEL  model folders or names (required)
#   TREE (2x5), VERIFIER (univer), PORT (8000)
set -eu
: "${TARGET_MODEL:?set TARGET_MODEL}"
: "${DRAFT_MODEL:?set DRAFT_MODEL}"
spec=$(printf '{"method": "univer", "model": "%s", "tree": "%s", "verifier": "%s"}' \
    "$DRAFT_MODEL" "${TREE:-2x5}" "${VERIFIER:-univer}")
exec vllm serve "$TARGET_MODEL" --host 0.0.0.0 --port "${PORT:-8000}" --speculative-config "$spec" "$@"
