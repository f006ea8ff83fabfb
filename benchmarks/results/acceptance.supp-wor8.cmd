2026-12-03 06:43  python benchmarks/acceptance.py --shapes 2x5 3x3 --schemes wor topk1 --temperatures 0.6 --supplement wor8 --seed 8 --steps 2 --prompts 40 --time-budget 2400
2026-12-03 07:23  python benchmarks/acceptance.py --shapes 2x5 3x3 --schemes wor topk1 --temperatures 0.6 --supplement wor8 --seed 8 --steps 2 --prompts 40 --time-budget 2100
