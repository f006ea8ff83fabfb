#!/usr/bin/env bash
# Compile every Triton kernel of the package for sm_90 with another Triton release
# (tests/core/test_triton_compiles.py), e.g. the one a GPU machine runs:
#   bash scripts/check_triton_compiles.sh 3.6.0
# The wheel is fetched from the package index once, into ~/.cache/vllm-univer.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
version="${1:?usage: check_triton_compiles.sh TRITON_VERSION}"
site="${HOME}/.cache/vllm-univer/triton-${version}"
source .venv/bin/activate
if [ ! -d "$site/triton" ]; then
  python -m pip install -q --no-deps --target "$site" "triton==${version}"
fi
VLLM_UNIVER_TRITON_SITE="$site" python -m pytest -q tests/core/test_triton_compiles.py -s | grep -E "with Triton|passed|failed|FAILURE"
