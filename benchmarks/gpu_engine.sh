#!/usr/bin/env bash
# The GPU checks on the lent H200, once the vLLM bundle's base and ops parts are installed
# (../shared/gpu/make_bundle.sh; per part `bash .gpu-bundle/<part>/install.sh`, one device
# call each, about 70 s together with the machine's start). Then one device call per part:
#
#   bash benchmarks/gpu_engine.sh graphs   # about 240 s: the engine under vLLM's piecewise CUDA
#                                          # graphs, target and draft, and with "cuda_graphs": "full"
#                                          # (tests/end_to_end/test_draft_forward.py -k cuda_graphs: greedy
#                                          # identity, drafts accepted as in an eager / piecewise engine)
#   bash benchmarks/gpu_engine.sh laws     # about 300 s: the T = 1 law (and top-k / top-p / min_p,
#                                          # dynamic trees, tree auto's graphs per cut) through vLLM under
#                                          # "cuda_graphs": "full", real capture (tests/end_to_end/
#                                          # test_engine_law.py -k real_cuda_graphs; the emulated law test
#                                          # runs in the CPU CI)
#   bash benchmarks/gpu_engine.sh check    # about 200 s: benchmarks/gpu_check.py (verifiers'
#                                          # laws, kernels, verify timings; cut off at GPU_CHECK_S),
#                                          # then attention_host_overhead.py (<= 45 s: host time per
#                                          # attention layer, ours and vLLM's, real launches)
#   bash benchmarks/gpu_engine.sh engine   # about 520 s: benchmarks/gpu_engine.py (step time and
#                                          # projected tokens/s against vLLM's draft_model chain)
#
# check + engine fit the 15 device minutes of a session (calls back to back: the machine stays
# warm about 30 s); with graphs too, shorten them (GPU_CHECK_S=120 GPU_ENGINE_S=450). `all` (the
# default) runs the three in one go where time is not counted.
# The engine part: 7B / 0.5B shapes, batch 1 8 32, vLLM's piecewise CUDA graphs, TRITON_ATTN
# (carry .gpu-bundle/fa3 and pass --attention-backend FLASH_ATTN for vLLM's default); rows most
# telling first and none started after its deadline. Compilation backend eager (vLLM's own CUDA
# ops between the graphs' pieces, no Inductor codegen): each engine's first start with Inductor
# compiles from a cold cache (2026-12-04: vLLM's chain k = 3 took over 120 s), which would leave
# room for 3-4 of the rows; pass --compile-backend inductor (and a larger GPU_ENGINE_S) for
# vLLM's default. Where two GPUs exist, `tp2` runs tests/end_to_end/test_parallel.py's tensor-parallel checks.
# Results go to $OUT (the device tool brings them back) or benchmarks/results.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
part="${1:-all}"
shift || true
[ -f .gpu-bundle/fa3/install.sh ] && bash .gpu-bundle/fa3/install.sh
[ -f /tmp/vllm-env.sh ] && source /tmp/vllm-env.sh
out="${OUT:-benchmarks/results}"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi -L || true
if [ "$part" = graphs ] || [ "$part" = all ]; then
  UNIVER_TEST_ATTENTION_BACKEND=TRITON_ATTN timeout "${GPU_GRAPHS_S:-240}" \
    python -m pytest -q -p no:cacheprovider tests/end_to_end/test_draft_forward.py -k cuda_graphs 2>&1 | tee "$out/graphs_gpu.txt"
fi
if [ "$part" = laws ] || [ "$part" = all ]; then
  UNIVER_TEST_ATTENTION_BACKEND=TRITON_ATTN timeout "${GPU_LAWS_S:-300}" \
    python -m pytest -q -p no:cacheprovider tests/end_to_end/test_engine_law.py -k real_cuda_graphs 2>&1 | tee "$out/laws_gpu.txt"
fi
if [ "$part" = check ] || [ "$part" = all ]; then
  timeout "${GPU_CHECK_S:-200}" python -m benchmarks.gpu_check --out "$out" \
    || echo "[gpu_engine.sh] gpu_check failed or cut off (rc=$?); its report keeps the sections done"
  timeout 45 python -m benchmarks.attention_host_overhead --reps 50 --out "$out" \
    || echo "[gpu_engine.sh] attention_host_overhead failed or cut off (rc=$?)"
fi
if [ "$part" = engine ] || [ "$part" = all ]; then
  budget="${GPU_ENGINE_S:-520}"
  timeout "$budget" python -m benchmarks.gpu_engine --out "$out" --engine-timeout 200 \
    --attention-backend TRITON_ATTN --compile-backend eager --deadline $((budget - 200)) "$@" \
    || echo "[gpu_engine.sh] gpu_engine stopped (rc=$?); its report keeps the rows done"
fi
if [ "$part" = tp2 ]; then
  timeout 540 python -m pytest -q tests/end_to_end/test_parallel.py -k tensor_parallel 2>&1 | tee "$out/tp2_gpu.txt"
fi
echo "[gpu_engine.sh] $part done in ${SECONDS} s"
