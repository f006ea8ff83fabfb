2026-12-06 07:07  python -m benchmarks.dynamic_trees --prompts 3 --steps 3 --time-budget 2700
