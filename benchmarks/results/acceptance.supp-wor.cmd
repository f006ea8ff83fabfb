2026-12-01 08:20  python benchmarks/acceptance.py --shapes 2x5 3x3 eagle61 --schemes wor --supplement wor --steps 2 --prompts 40 --time-budget 1800
