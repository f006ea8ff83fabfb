2026-12-03 01:57  python benchmarks/acceptance.py --shapes 2x5 3x3 --schemes wor topk1 --supplement wor6 --seed 6 --steps 2 --prompts 40 --time-budget 2100
