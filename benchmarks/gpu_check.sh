#!/usr/bin/env bash
# The device check, as one command for the lent GPU machine (PyTorch and Triton
# are there; vLLM is not): correctness on CUDA, then timings. Results go to
# $OUT (the device tool brings them back) or benchmarks/results.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHONPATH=. python -m benchmarks.gpu_check --out "${OUT:-benchmarks/results}"
