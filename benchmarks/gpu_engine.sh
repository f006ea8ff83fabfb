#!/usr/bin/env bash
# The GPU engine check as one command on the lent H200, once the vLLM bundle is
# installed (../shared/gpu/make_bundle.sh; then per part `bash .gpu-bundle/<part>/install.sh`):
#   1. benchmarks/gpu_check.py: verifiers' laws, tree-attention kernels, verify timings
#      (fused Triton path beside the PyTorch one);
#   2. benchmarks/gpu_engine.py: step time and projected tokens/s of univer against
#      vLLM's draft_model chain and no speculation (7B / 0.5B shapes, batch 1 8 32),
#      with vLLM's piecewise CUDA graphs;
#   3. where two GPUs exist: tensor parallel 2 (tests/test_parallel.py: greedy identity,
#      the T = 1 law, every rank taking the same decisions), on the GPUs.
# Results go to $OUT (the device tool brings them back) or benchmarks/results.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ -f /tmp/vllm-env.sh ] && source /tmp/vllm-env.sh
out="${OUT:-benchmarks/results}"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
timeout 150 python benchmarks/gpu_check.py --out "$out" || echo "[gpu_engine.sh] gpu_check failed or timed out (rc=$?)"
python benchmarks/gpu_engine.py --out "$out" --engine-timeout 120 "$@"
gpus=$(nvidia-smi -L 2>/dev/null | wc -l || true)
if [ "${gpus:-0}" -ge 2 ]; then
  timeout 900 python -m pytest -q tests/test_parallel.py -k tensor_parallel 2>&1 | tee "$out/tp2_gpu.txt" \
    || echo "[gpu_engine.sh] tensor-parallel check failed or timed out (rc=$?)"
else
  echo "[gpu_engine.sh] ${gpus:-0} GPU(s): tensor-parallel check skipped (needs 2)"
fi
