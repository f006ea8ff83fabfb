2026-12-06 15:23  python -m benchmarks.dynamic_trees --prompts 3 --steps 3 --time-budget 1200 --out dynamic_trees_chains
