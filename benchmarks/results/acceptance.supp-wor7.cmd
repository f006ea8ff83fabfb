2026-12-03 10:23  python benchmarks/acceptance.py --shapes eagle61 --schemes wor --supplement wor7 --seed 7 --steps 2 --prompts 40 --time-budget 2400
2026-12-03 11:13  python benchmarks/acceptance.py --shapes eagle61 --schemes wor --supplement wor7 --seed 7 --steps 2 --prompts 40 --time-budget 2280
