2026-12-06 11:11  python -m benchmarks.dynamic_trees --prompts 3 --steps 3 --time-budget 1500
