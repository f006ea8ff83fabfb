2026-11-29 08:47  python benchmarks/acceptance.py --quick --restart
