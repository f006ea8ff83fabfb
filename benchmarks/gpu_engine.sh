#!/usr/bin/env bash
# The GPU checks as one command on the lent H200, inside one device call, once the vLLM
# bundle's base and ops parts are installed (../shared/gpu/make_bundle.sh; per part
# `bash .gpu-bundle/<part>/install.sh`). Carry .gpu-bundle/fa3 with this call: it is
# installed first (the FLASH_ATTN backend needs it).
#   1. benchmarks/gpu_check.py: verifiers' laws, tree-attention kernels, verify timings
#      (fused Triton path beside the PyTorch one), cut off after GPU_CHECK_S seconds
#      (it rewrites its report after each section);
#   2. benchmarks/gpu_engine.py: step time and projected tokens/s of univer against vLLM's
#      draft_model chain and no speculation (7B / 0.5B shapes, batch 1 8 32), vLLM's
#      piecewise CUDA graphs, TRITON_ATTN; rows most telling first, none started late;
#   3. with the time left, the same engines' first rows on FLASH_ATTN (gpu_engine_flash.md);
#   4. where two GPUs exist: tensor parallel 2 (tests/test_parallel.py).
# The whole stays inside GPU_BUDGET_S seconds (default 530). Results go to $OUT (the
# device tool brings them back) or benchmarks/results.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
budget=${GPU_BUDGET_S:-530}
left() { echo $((budget - SECONDS)); }
[ -f .gpu-bundle/fa3/install.sh ] && bash .gpu-bundle/fa3/install.sh
[ -f /tmp/vllm-env.sh ] && source /tmp/vllm-env.sh
out="${OUT:-benchmarks/results}"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi -L || true
timeout "${GPU_CHECK_S:-110}" python benchmarks/gpu_check.py --out "$out" \
  || echo "[gpu_engine.sh] gpu_check failed or timed out (rc=$?)"
# Rows start only while 150 s (one engine's timeout) plus 60 s for step 3 remain.
timeout $(($(left) - 30)) python benchmarks/gpu_engine.py --out "$out" --engine-timeout 150 \
  --attention-backend TRITON_ATTN --deadline $(($(left) - 210)) "$@" \
  || echo "[gpu_engine.sh] gpu_engine stopped (rc=$?)"
if [ "$(left)" -ge 100 ]; then
  timeout $(($(left) - 10)) python benchmarks/gpu_engine.py --out "$out" --engine-timeout 90 --stem gpu_engine_flash \
    --attention-backend FLASH_ATTN --deadline $(($(left) - 100)) --batches 1 32 \
    --rows "no speculation" "vLLM chain k=3" "univer 2x3" \
    || echo "[gpu_engine.sh] gpu_engine FLASH_ATTN stopped (rc=$?)"
fi
gpus=$(nvidia-smi -L 2>/dev/null | wc -l || true)
if [ "${gpus:-0}" -ge 2 ] && [ "$(left)" -ge 120 ]; then
  timeout $(($(left) - 10)) python -m pytest -q tests/test_parallel.py -k tensor_parallel 2>&1 | tee "$out/tp2_gpu.txt" \
    || echo "[gpu_engine.sh] tensor-parallel check failed or timed out (rc=$?)"
else
  echo "[gpu_engine.sh] ${gpus:-0} GPU(s) or too little time: tensor-parallel check skipped (needs 2)"
fi
echo "[gpu_engine.sh] done in ${SECONDS} s"
