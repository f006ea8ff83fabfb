#!/usr/bin/env bash
# The test command: set up ./.venv from nothing (vLLM 0.32.0 CPU or CUDA build,
# this package, test tools), check formatting and lint (ruff, pyproject.toml),
# and run the whole test suite: TEST_WORKERS pytest-xdist workers (default 2;
# many tests wait on one core, in Triton's interpreter or an engine start-up),
# the 25 slowest tests listed at the end.
#
#   bash scripts/test.sh --quick   the inner-loop tier (tests marked `quick`: exact laws,
#                                  API, errors; a few minutes), same set-up and lint
#   bash scripts/test.sh ARGS      ARGS go to pytest (e.g. a file, -k EXPR)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/setup_venv.sh"
cd "$repo"
"${VENV:-$repo/.venv}/bin/ruff" format --check .
"${VENV:-$repo/.venv}/bin/ruff" check .
if [[ "${1:-}" == "--quick" ]]; then
  shift
  set -- -m quick "$@"
fi
exec "${VENV:-$repo/.venv}/bin/python" -m pytest -q -n "${TEST_WORKERS:-2}" --dist worksteal --durations=25 "$@"
