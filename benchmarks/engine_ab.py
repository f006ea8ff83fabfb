"""Engines of ``engine.py`` alternating on one matrix cell: a paired comparison.

``engine.py`` runs one engine per row, the rows one after the other. On this
machine two engines of the same configuration run up to 13 % apart, each at
its own speed for as long as its process lives: more than some of the effects
the matrix is read for (``tree: auto`` running plain steps only, against the
engine without speculation). Here the named rows take turns on the same cell,
in both orders:

    python -m benchmarks.engine_ab --rows "no speculation" "univer auto" --dataset humaneval --batch 8 --temperature 0

either in rounds, each round starting every engine afresh (its own process,
warm-up included; tok/s the fastest of ``--repeats`` runs, as in
``engine.py``), or with ``--interleave RUNS``: every engine alive at once,
taking turns run by run, so that a ratio pairs runs seconds apart. Prints
tokens/s per row and round (or run) and the paired ratios of every row to the
first, and appends the table to ``benchmarks/results/engine_ab.md``, with each
engine's step split into the target forward, the rest of the runner and what
runs outside it, and the step against the first row's with its target forward
replaced by the first row's. A row named twice runs as two engines of the same
configuration (an A/A pair: the spread between engines, against which the
other ratios are read).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

from benchmarks.engine import ENV, MAX_BATCH, RESULTS, device_label, engine_configs, engine_job
from vllm_univer.tools.json_job import JsonWorker, run_json_job

HERE = Path(__file__).resolve().parent


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
    ap.add_argument("--single-prompts", type=int, default=1, help="at batch 1: prompts per run, one request at a time")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--interleave",
        type=int,
        default=0,
        metavar="RUNS",
        help="instead of rounds of fresh engines: every row's engine alive at once (a smaller KV cache each), "
        "RUNS timed runs each, taking turns run by run (a ratio pairs runs seconds apart)",
    )
    ap.add_argument(
        "--statistic",
        choices=["fastest", "mean"],
        default="fastest",
        help="per engine, the fastest of its repeats (as engine.py) or their mean: at T > 0 the fastest "
        "favours the row whose tau varies most between runs (a deep chain)",
    )
    args = ap.parse_args()
    from vllm_univer.tools.real_models import DEFAULT_DRAFT, DEFAULT_TARGET, model_dir, prompts

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
    jobs = {
        name: engine_job(configs[config_of[name]], [cell], target, draft, texts, 1, 1, args.single_prompts)
        for name in labels
    }
    runs = interleaved_runs(jobs, cell, args.interleave) if args.interleave else fresh_engine_runs(jobs, cell, args)
    for r, name, value, cell_result in runs:
        speed[name].append(value)
        cuts[name].update(cell_result.get("requests_at_cut", {}))
        splits[name].append(step_split(cell_result))
        _, tokens, forward, *_ = splits[name][-1]
        print(
            f"{'run' if args.interleave else 'round'} {r} {name}: {value:.2f} tok/s, target forward "
            f"{forward:.1f} ms/step over {tokens:.1f} tokens",
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
        [*settings, "python -m benchmarks.engine_ab", *(f'"{a}"' if " " in a else a for a in sys.argv[1:])]
    )
    lines = [
        "",
        f"## {args.dataset}, batch {args.batch}, T = {' / '.join(f'{t:g}' for t in args.temperature)}"
        f"{' (one per request in turn)' if len(args.temperature) > 1 else ''}, {new_tokens} tokens",
        "",
        f"Command: `{command}`. Machine: {device_label()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        f"Every row's engine alive at once (KV cache {INTERLEAVED_KV_GB} GB each), {args.interleave} timed runs each, "
        "taking turns run by run (in reverse order every other turn); a ratio pairs the runs of one turn."
        if args.interleave
        else f"tok/s per engine: the {args.statistic} of its {args.repeats} runs.",
        "",
        f"| row | tok/s per {'run' if args.interleave else 'round'} | mean | vs {args.rows[0]}, paired "
        "(mean +- standard error, min .. max) |",
        "|---|---|---|---|",
    ]
    for name, values in speed.items():
        ratio = np.asarray(values) / base
        error = ratio.std(ddof=1) / np.sqrt(len(ratio)) if len(ratio) > 1 else float("nan")
        lines.append(
            f"| {name} | {' / '.join(f'{v:.2f}' for v in values)} | {np.mean(values):.2f} | "
            f"{ratio.mean():.3f}x +- {error:.3f} ({ratio.min():.3f} .. {ratio.max():.3f}) |"
        )
    lines += [
        "",
        "ms per engine step of that run, mean over rounds (on CPU each part's wall time is its work): "
        "the target forward (and its query tokens per step, padding included); the rest of the runner's "
        "`execute_model` (inputs, attention metadata, logits); its `sample_tokens` (sampling or verification, "
        "drafting); everything outside the runner (scheduler, outputs). Last column, where a row's target "
        f"forward runs the same query tokens as {labels[0]}'s: the step's speed against {labels[0]}'s with its "
        f"target forward replaced by {labels[0]}'s, i.e. what the row adds to the step beside the forward (the "
        "same vLLM code on the same rows, whose speed differs between processes: see an A/A pair).",
        "",
        "| row | steps | target tokens | target forward | rest of execute_model | sample_tokens | outside the runner "
        f"| step | vs {labels[0]} at its target forward |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base_steps, base_tokens, base_forward, *base_ms = np.mean(splits[labels[0]], axis=0)
    base_step = base_forward + sum(base_ms)
    for name, rounds in splits.items():
        steps, tokens, *ms = np.mean(rounds, axis=0)
        same_rows = steps == base_steps and abs(tokens - base_tokens) < 1e-6
        at_base = f"{base_step / (sum(ms) - ms[0] + base_forward):.3f}x" if same_rows else "-"
        lines.append(
            f"| {name} | {steps:.0f} | {tokens:.1f} | "
            + " | ".join(f"{v:.1f}" for v in ms)
            + f" | {sum(ms):.1f} | {at_base} |"
        )
    for name, counts in cuts.items():
        if counts:
            total = sum(counts.values())
            shares = " / ".join(f"{cut}: {100 * n / total:.0f}%" for cut, n in sorted(counts.items()))
            lines += [
                "",
                f"`{name}` drafted (width x depth cut, 0x0: no speculation; "
                f"{'every timed run' if args.interleave else 'the fastest run of each round'}): {shares}.",
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


def fresh_engine_runs(jobs: dict, cell: tuple, args):
    """Rounds of fresh engines: each round starts every row's engine in its own process
    (in reverse order every other round) -> (round, row, tok/s, its run's result)."""
    labels = list(jobs)
    for r in range(args.rounds):
        # Every other round in reverse order: no row always runs first after a pause.
        for name in labels if r % 2 == 0 else labels[::-1]:
            job = {**jobs[name], "repeats": args.repeats, "single_repeats": args.repeats}
            result, stderr = run_json_job(
                ["-m", "benchmarks.engine", "--one"], job, {**os.environ, **ENV, **job["env"]}
            )
            if result is None:
                raise RuntimeError(f"{name} failed:\n{stderr[-5000:]}")
            cell_result = result["cells"][0]
            runs = cell_result["tok_per_s_runs"]
            yield r, name, max(runs) if args.statistic == "fastest" else float(np.mean(runs)), cell_result


# Each engine's KV cache where several are alive at once (ENV's 4 GB each would not fit
# beside the models in 24 GB; a batch-16 cell needs a few hundred MB).
INTERLEAVED_KV_GB = 1
# Seconds between two runs: an idle engine's OpenMP threads spin a while after its run.
TURN_PAUSE_S = 1.0


def interleaved_runs(jobs: dict, cell: tuple, runs: int):
    """Every row's engine alive at once (``engine.py --serve``), one untimed run each,
    then ``runs`` timed runs each, taking turns run by run -> (run, row, tok/s, its result)."""
    labels = list(jobs)
    env = {**os.environ, **ENV, "VLLM_CPU_KVCACHE_SPACE": str(INTERLEAVED_KV_GB)}
    workers = {}
    try:
        for name in labels:  # started one at a time: loading two models at once would skew nothing but is slow
            log = f"/tmp/engine_ab_{len(workers)}.log"
            workers[name] = JsonWorker(
                ["-m", "benchmarks.engine", "--serve"], jobs[name], {**env, **jobs[name]["env"]}, log
            )
            workers[name].ask(list(cell))  # the first run of a cell is slow (first-time work at its shapes)
        for r in range(runs):
            for name in labels if r % 2 == 0 else labels[::-1]:
                time.sleep(TURN_PAUSE_S)
                result = workers[name].ask(list(cell))
                yield r, name, result["tok_per_s"], result
    finally:
        for worker in workers.values():
            worker.close()


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
