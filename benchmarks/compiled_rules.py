"""univer_wor's ``verify`` with its node rule compiled (``compiled_rules``) against
the eager rule, side by side in one run; univer (its fused kernels on CUDA, eager
here) and traversal as references.

Per cell: best of ``--repeat`` calls, float32, T = 1, trees drafted from q without
replacement (``verifier_overhead.make_inputs``), and the first compiled call of
each tree (compilation included; Inductor's on-disk cache is emptied first, so
it is what a first start pays). Writes ``results/compiled_rules.md``.

    python -m benchmarks.compiled_rules                 # V = 151936, B 1 / 8, 2x5 3x3 eagle61
    python -m benchmarks.compiled_rules --batches 1 --trees 2x5
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from benchmarks.acceptance import eagle_like_tree
from benchmarks.verifier_overhead import make_inputs, time_call
from vllm_univer import TreeSpec, verify

RESULTS = Path(__file__).parent / "results"


def tree_named(name: str) -> TreeSpec:
    return eagle_like_tree() if name == "eagle61" else TreeSpec.parse(name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--trees", nargs="+", default=["2x5", "3x3", "eagle61"])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    # A fresh Inductor cache: the first call's time is a first start's.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache = tempfile.mkdtemp(prefix="inductor-")

    header = [
        "tree",
        "B",
        "univer_wor eager ms",
        "univer_wor compiled ms",
        "eager / compiled",
        "first compiled call s",
        "univer ms",
        "traversal ms",
        "compiled / univer",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    print(lines[0], flush=True)
    for tree_name in args.trees:
        tree = tree_named(tree_name)
        for batch in args.batches:
            times = {}
            for method in ("univer_wor", "univer", "traversal"):
                tokens, p, q = make_inputs(method, tree, batch, args.vocab)
                gen = torch.Generator().manual_seed(0)
                variants = {"eager": False, "compiled": True} if method == "univer_wor" else {"": None}
                for label, compiled in variants.items():

                    def call(tokens=tokens, p=p, q=q, compiled=compiled, method=method):
                        verify(method, tree, tokens, p, q, generator=gen, validate=False, compiled=compiled)

                    if compiled:
                        start = time.perf_counter()
                        call()
                        times["first"] = time.perf_counter() - start
                    times[(method, label)] = time_call(call, args.repeat)
                del tokens, p, q
            eager, compiled = times[("univer_wor", "eager")], times[("univer_wor", "compiled")]
            univer, traversal = times[("univer", "")], times[("traversal", "")]
            row = [
                tree_name,
                batch,
                f"{eager * 1e3:.1f}",
                f"{compiled * 1e3:.1f}",
                f"{eager / compiled:.2f}x",
                f"{times['first']:.1f}",
                f"{univer * 1e3:.1f}",
                f"{traversal * 1e3:.1f}",
                f"{compiled / univer:.2f}x",
            ]
            lines.append("| " + " | ".join(str(x) for x in row) + " |")
            print(lines[-1], flush=True)
    shutil.rmtree(cache, ignore_errors=True)

    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    cpu = platform.processor() or platform.machine()
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    machine = f"{cpu}, {os.cpu_count()} CPU cores, torch {torch.__version__}, threads {torch.get_num_threads()}"
    out = RESULTS / "compiled_rules.md"
    RESULTS.mkdir(exist_ok=True)
    out.write_text(
        "\n".join(
            [
                f"# univer_wor: node rule compiled by torch.compile vs eager ({stamp})",
                "",
                f"Command: `python -m benchmarks.compiled_rules {' '.join(sys.argv[1:])}`",
                "",
                f"Machine: {machine}",
                "",
                f"verify per call, best of {args.repeat} (float32, T = 1, V = {args.vocab}, no input validation);"
                " 'first compiled call': the first call at this tree and batch size, compilation included"
                " (Inductor's cache empty at the start of the run; a batch size after the first of a tree"
                " reuses its graphs). univer and traversal: eager PyTorch rules here (on CUDA univer takes"
                " its Triton kernels).",
                "",
                *lines,
                "",
            ]
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
