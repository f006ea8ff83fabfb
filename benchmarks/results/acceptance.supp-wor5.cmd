2026-12-02 23:59  python benchmarks/acceptance.py --shapes 2x5 3x3 eagle61 --schemes wor --supplement wor5 --seed 5 --steps 2 --prompts 40 --time-budget 2400
2026-12-03 00:41  python benchmarks/acceptance.py --shapes 2x5 3x3 eagle61 --schemes wor --supplement wor5 --seed 5 --steps 2 --prompts 40 --time-budget 1500
