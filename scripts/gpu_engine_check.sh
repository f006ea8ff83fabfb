#!/usr/bin/env bash
# The CUDA engine check, for a GPU machine that can install vLLM's CUDA wheel
# (the lent device machine cannot: no network, and the wheel is over its 64 MiB
# carry limit). About 30 minutes on one H200:
#   1. the kernels and the CUDA backends' hook (also run on CPU by the test suite);
#   2. the engine tests on CUDA through vLLM's FlashAttention backend: greedy
#      identity for every verifier and tree, preemption, chunked prefill, mixed
#      batches, the goodness-of-fit law tests, errors, a real server;
#   3. the same with the Triton attention backend (greedy identity only), then greedy identity
#      and the T = 1 law with CUDA graphs through both backends;
#   4. the kernel timings (benchmarks/gpu_check.py) and the engine benchmark on
#      the real Qwen pair, written to benchmarks/results/*_gpu.md.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
nvidia-smi >/dev/null || { echo "no GPU visible (nvidia-smi failed)" >&2; exit 1; }
bash scripts/setup_venv.sh  # the CUDA build when nvidia-smi sees a GPU
py="${VENV:-$repo/.venv}/bin/python"
"$py" -m pytest -q tests/integration/attention/test_triton_tree_attention.py tests/integration/attention/test_cuda_tree_attention.py
UNIVER_TEST_ATTENTION_BACKEND=FLASH_ATTN "$py" -m pytest -q tests/end_to_end/test_engine.py tests/end_to_end/test_engine_law.py tests/end_to_end/test_engine_errors.py \
    tests/end_to_end/test_engine_options.py tests/end_to_end/test_server.py tests/end_to_end/test_draft_forward.py
UNIVER_TEST_ATTENTION_BACKEND=TRITON_ATTN "$py" -m pytest -q tests/end_to_end/test_engine.py -k "every_verifier"
# The same under vLLM's piecewise CUDA graphs (target and draft), both backends.
for backend in FLASH_ATTN TRITON_ATTN; do
  UNIVER_TEST_CUDA_GRAPHS=1 UNIVER_TEST_ATTENTION_BACKEND=$backend "$py" -m pytest -q tests/end_to_end/test_engine.py \
      tests/end_to_end/test_engine_law.py -k "generated_law or every_verifier"
done
PYTHONPATH=. "$py" -m benchmarks.gpu_check --out benchmarks/results
"$py" -m benchmarks.engine --tag gpu
