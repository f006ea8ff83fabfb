2026-12-02 21:54  python benchmarks/acceptance.py --quick --shapes 2x5 3x3 --schemes wor --supplement wor3 --time-budget 600
