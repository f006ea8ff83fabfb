2026-12-07 16:26  python -m benchmarks.acceptance --quick --restart --temperatures 0.3 1.0 --shapes 2x5 --time-budget 780
