"""Engines of ``engine.py`` alternating on one matrix cell: a drift-paired comparison.

``engine.py`` runs one engine per row, the rows one after the other; this
machine's speed drifts between them by more than some of the effects it is
read for (``tree: auto`` running plain steps only, against the engine without
speculation). Here the named rows take turns, each round starting every engine
afresh (its own process, warm-up included) on the same cell, so that each
round's ratio compares engines minutes apart at most, in both orders:

    python benchmarks/engine_ab.py --rows "no speculation" "univer auto" --dataset humaneval --batch 8 --temperature 0

Prints tokens/s per row and round (each the fastest of ``--repeats`` runs, as in
``engine.py``) and the paired ratios of every row to the first, and appends
the table to ``benchmarks/results/engine_ab.md``, with each engine's step split
into the target forward, the rest of the runner and what runs outside it. A
row named twice runs as two engines of the same configuration (an A/A pair:
the drift between fresh engines, against which the other ratios are read).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from engine import ENV, MAX_BATCH, RESULTS, device_label, engine_configs, engine_job  # noqa: E402

from vllm_univer.tools.json_job import run_json_job  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--rows", nargs="+", required=True, metavar="NAME", help="engine.py row names; the first is the base"
    )
    ap.add_argument("--dataset", default="humaneval", choices=["mtbench", "humaneval"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument(
        "--temperature",
        type=float,
        nargs="+",
        default=[0.0],
        help="several: one per request in turn (a batch of mixed sampling parameters)",
    )
    ap.add_argument("--new-tokens", type=int, default=None, help="default: as in engine.py's matrix")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--statistic",
        choices=["fastest", "mean"],
        default="fastest",
        help="per engine, the fastest of its repeats (as engine.py) or their mean: at T > 0 the fastest "
        "favours the row whose tau varies most between runs (a deep chain)",
    )
    args = ap.parse_args()
    from data import DEFAULT_DRAFT, DEFAULT_TARGET, model_dir, prompts

    configs = {c["name"]: c for c in engine_configs(quick=False)}
    unknown = [name for name in args.rows if name not in configs]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; engine.py has {sorted(configs)}")
    new_tokens = args.new_tokens or (64 if args.batch == 1 else 32)
    temperature = args.temperature[0] if len(args.temperature) == 1 else args.temperature
    cell = (args.batch, temperature, new_tokens, args.dataset)
    texts = {d: [p["turns"][0] for p in prompts(d, limit=MAX_BATCH)] for d in ("mtbench", "humaneval")}
    target, draft = str(model_dir(DEFAULT_TARGET)), str(model_dir(DEFAULT_DRAFT))
    # A row named twice runs twice per round, as two rows ("name #2"): an A/A pair
    # measures how far two fresh engines of the same configuration drift apart.
    labels = [
        name if args.rows[:i].count(name) == 0 else f"{name} #{args.rows[:i].count(name) + 1}"
        for i, name in enumerate(args.rows)
    ]
    config_of = dict(zip(labels, args.rows))
    speed: dict[str, list[float]] = {name: [] for name in labels}
    cuts: dict[str, Counter] = {name: Counter() for name in labels}  # tree auto: request-steps per cut
    splits: dict[str, list[np.ndarray]] = {name: [] for name in labels}  # ms per step, see step_split
    for r in range(args.rounds):
        # Every other round in reverse order: no row always runs first after a pause.
        order = labels if r % 2 == 0 else labels[::-1]
        for name in order:
            job = engine_job(configs[config_of[name]], [cell], target, draft, texts, args.repeats, args.repeats)
            result, stderr = run_json_job([str(HERE / "engine.py"), "--one"], job, {**os.environ, **ENV, **job["env"]})
            if result is None:
                raise RuntimeError(f"{name} failed:\n{stderr[-5000:]}")
            cell_result = result["cells"][0]
            runs = cell_result["tok_per_s_runs"]
            speed[name].append(max(runs) if args.statistic == "fastest" else float(np.mean(runs)))
            cuts[name].update(cell_result.get("requests_at_cut", {}))
            splits[name].append(step_split(cell_result))
            _, tokens, forward, *_ = splits[name][-1]
            print(
                f"round {r} {name}: {speed[name][-1]:.2f} tok/s, target forward {forward:.1f} ms/step "
                f"over {tokens:.1f} tokens",
                flush=True,
            )
            if "sizer_state" in cell_result:  # tree auto: its cuts and what it knew at the end
                print(f"  cuts {cell_result.get('requests_at_cut')}, {cell_result['sizer_state']}", flush=True)

    base = np.asarray(speed[labels[0]])
    # Settings of the allocator, the OpenMP runtime or the thread binding change every engine's speed: part
    # of the command.
    speed_settings = ("THP_MEM_ALLOC_ENABLE", "VLLM_CPU_OMP_THREADS_BIND", "LD_PRELOAD")
    settings = [f"{k}={os.environ[k]}" for k in speed_settings if k in os.environ]
    command = " ".join(
        [*settings, "python benchmarks/engine_ab.py", *(f'"{a}"' if " " in a else a for a in sys.argv[1:])]
    )
    lines = [
        "",
        f"## {args.dataset}, batch {args.batch}, T = {' / '.join(f'{t:g}' for t in args.temperature)}"
        f"{' (one per request in turn)' if len(args.temperature) > 1 else ''}, {new_tokens} tokens",
        "",
        f"Command: `{command}`. Machine: {device_label()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        f"tok/s per engine: the {args.statistic} of its {args.repeats} runs.",
        "",
        f"| row | tok/s per round | mean | vs {args.rows[0]}, paired (mean, min .. max) |",
        "|---|---|---|---|",
    ]
    for name, values in speed.items():
        ratio = np.asarray(values) / base
        lines.append(
            f"| {name} | {' / '.join(f'{v:.2f}' for v in values)} | {np.mean(values):.2f} | "
            f"{ratio.mean():.3f}x ({ratio.min():.3f} .. {ratio.max():.3f}) |"
        )
    lines += [
        "",
        "ms per engine step of that run, mean over rounds (on CPU each part's wall time is its work): "
        "the target forward (and its query tokens per step, padding included); the rest of the runner's "
        "`execute_model` (inputs, attention metadata, logits); its `sample_tokens` (sampling or verification, "
        "drafting); everything outside the runner (scheduler, outputs).",
        "",
        "| row | steps | target tokens | target forward | rest of execute_model | sample_tokens | outside the runner "
        "| step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, rounds in splits.items():
        steps, tokens, *ms = np.mean(rounds, axis=0)
        lines.append(
            f"| {name} | {steps:.0f} | {tokens:.1f} | " + " | ".join(f"{v:.1f}" for v in ms) + f" | {sum(ms):.1f} |"
        )
    for name, counts in cuts.items():
        if counts:
            total = sum(counts.values())
            shares = " / ".join(f"{cut}: {100 * n / total:.0f}%" for cut, n in sorted(counts.items()))
            lines += [
                "",
                f"`{name}` drafted (width x depth cut, 0x0: no speculation; the fastest run of each round): {shares}.",
            ]
    text = "\n".join(lines) + "\n"
    out = RESULTS / "engine_ab.md"
    if not out.exists():
        out.write_text(
            "# engine.py rows alternating on one cell\n\nEach round starts every named engine afresh "
            "(`benchmarks/engine_ab.py`), in alternating order; tok/s is the fastest of the repeats in that "
            "engine, as in `engine.md`.\n"
        )
    with out.open("a") as f:
        f.write(text)
    print(text)


def step_split(cell: dict) -> np.ndarray:
    """[steps, target query tokens per step, then ms per step: target forward, rest of
    execute_model, sample_tokens, outside the runner] of one timed run (``engine.py``'s
    ``step_parts_s``)."""
    parts = cell["step_parts_s"]
    steps = max(parts["steps"], 1)
    forward, execute, sample = parts["_model_forward"], parts["execute_model"], parts["sample_tokens"]
    outside = cell["wall_s"] - execute - sample
    ms = 1000 * np.array([forward, execute - forward, sample, outside]) / steps
    return np.array([parts["steps"], parts.get("target_tokens", 0) / steps, *ms])


if __name__ == "__main__":
    main()
