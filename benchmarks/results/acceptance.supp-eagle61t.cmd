2026-11-29 10:19  python benchmarks/acceptance.py --shapes 2x5 eagle61t --supplement eagle61t --steps 2 --prompts 40 --time-budget 1140
