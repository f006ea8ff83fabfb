"""Where ``univer_wor`` loses on irregular wor trees: the EAGLE-like tree of
``lp_optimum.py`` (its worst case, 91.1 % of the optimum on smooth laws) taken
apart into trees that keep one of its features each.

Each row is one tree (paths of child slots), its LP optimum over all lossless
verifiers and the exact E[accepted] of ``univer_wor`` and ``traversal`` as a
share of it, mean over a few random target/draft pairs per model kind (the
models of ``lp_optimum.py``). A root with two children of uneven subtrees is
settled well by the weighted pair rule; three children at the root, where the
pair rule and a lone third slot run (the three-child stage runs above leaves
only), are where the gap is.

    python -m benchmarks.studies.wor_irregular_gap    # writes benchmarks/results/wor_irregular_gap.md
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

from benchmarks.lp_optimum import IRREGULAR_SHAPES, MODEL_KINDS, optimum_and_methods
from vllm_univer import TreeSpec

ROOT = Path(__file__).resolve().parents[1]  # benchmarks/

SHAPES = {
    "eagle-like": IRREGULAR_SHAPES["eagle-like"],
    "2 at the root: (2, 1) kids": [(0,), (1,), (0, 0), (0, 1), (1, 0)],
    "3 at the root: (1, 1, 0) kids": [(0,), (1,), (2,), (0, 0), (1, 0)],
    "3 at the root: (2, 0, 0) kids": [(0,), (1,), (2,), (0, 0), (0, 1)],
    "3 at the root: leaves (3x1)": [(0,), (1,), (2,)],
}
METHODS = ("univer_wor", "traversal")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=4, help="random target/draft pairs per model kind")
    parser.add_argument("--vocab", type=int, default=4)
    args = parser.parse_args()
    lines = [
        "# Where univer_wor loses on irregular wor trees (exact, synthetic)",
        "",
        f"Command: `python -m benchmarks.studies.wor_irregular_gap --pairs {args.pairs} --vocab {args.vocab}` "
        f"({platform.machine()}, Python {sys.version.split()[0]}). V = {args.vocab}; mean over {args.pairs} "
        "random target/draft pairs per model kind (`lp_optimum.py`'s models); shares of the LP optimum.",
        "",
        "| models | tree (children per root child) | paths | LP | univer_wor | traversal |",
        "|---|---|---|---|---|---|",
    ]
    for kind in MODEL_KINDS:
        for name, paths in SHAPES.items():
            tree = TreeSpec.from_paths(paths)
            start = time.time()
            pairs = [MODEL_KINDS[kind](args.vocab, seed) for seed in range(args.pairs)]
            lp, values = optimum_and_methods("wor", tree, pairs, METHODS, (kind, name))
            shares = " | ".join(f"{100 * values[m] / lp:.1f} %" for m in METHODS)
            lines.append(f"| {kind} | {name} | {paths} | {lp:.4f} | {shares} |")
            print(lines[-1], f"({time.time() - start:.0f} s)", flush=True)
    out = ROOT / "results" / "wor_irregular_gap.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
