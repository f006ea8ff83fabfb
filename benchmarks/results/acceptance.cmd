2026-11-29 09:18  python benchmarks/acceptance.py --restart --steps 2 --prompts 40 --time-budget 3600
