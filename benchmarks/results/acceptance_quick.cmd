2026-12-01 05:56  python benchmarks/acceptance.py --quick --restart --time-budget 1080
