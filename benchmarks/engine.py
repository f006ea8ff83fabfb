"""Tree speculation through vLLM, side by side, on the real Qwen pair (CPU or CUDA build).

For each engine configuration (no speculation, vLLM's own ``draft_model`` chain
with k = 5, ``univer`` with each verifier) one engine runs, in its own process,
the same prompts (MT-Bench, round robin over categories, and HumanEval; chat template) at each
(batch size, temperature) of the matrix, and the script records:

* output tokens/s (wall clock of ``generate``, after a warm-up request) and its
  ratio to no speculation in the same matrix cell;
* mean acceptance length per step, tau = 1 + accepted / drafts (vLLM's own
  spec-decode counters), and acceptance per depth;
* for ``univer``, the share of wall time spent in tree bookkeeping, verification
  and KV moves (outside the target and draft forward passes), from the
  package's step timers (``VLLM_UNIVER_TIMERS=1``).

    python -m benchmarks.engine                       # the default matrix (about 40 min on 2 cores)
    python -m benchmarks.engine --quick               # one prompt batch, fewer engines
    python -m benchmarks.engine --rerun "univer auto" "no speculation" --rounds 2   # drift-averaged rows

This machine's speed drifts between fresh engines by about +-5 %, more than
the 3 % the ``auto`` goal line is read at. ``--rounds R`` runs the speed rows
R times, each round starting every engine afresh and taking the rows in the
opposite order to the round before; a row's tokens/s per cell is then the mean
over its R engines (each the fastest of its repeats), and the goal line is read
from those means.

The full matrix also runs structured outputs (a JSON schema, ``(JSON)`` rows) without speculation,
with vLLM's chain and with univer 2x3; those rows are compared with the JSON row without speculation.
Results: ``benchmarks/results/engine.md`` and ``engine.json`` (``--tag gpu``: ``engine_gpu.*``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from vllm_univer.integration.tree_sizer import ONE_DEPTH_ENV, SCHEDULE_ENV
from vllm_univer.tools.json_job import print_result, run_json_job
from vllm_univer.tools.serving_defaults import LOCAL_SERVER_ENV, serving_dtype

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

ENV = {
    **LOCAL_SERVER_ENV,
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_UNIVER_TIMERS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

# (batch, temperature, new tokens, prompt set): the speed matrix of tree 'auto' against every other row.
SPEED_CELLS = [
    (batch, temperature, 64 if batch == 1 else 32, dataset)
    for dataset in ("mtbench", "humaneval")
    for batch in (8, 16, 1)
    for temperature in (1.0, 0.0)
]
ACCEPTANCE_CELLS = [(8, 1.0, 32, "mtbench")]
# Structured outputs rows: every request answers in this JSON schema (the text may end early).
JSON_CELLS = [(8, 0.0, 64, "mtbench"), (8, 1.0, 64, "mtbench")]
MAX_BATCH = max(c[0] for c in SPEED_CELLS)
JSON_SCHEMA = {
    "type": "object",
    "properties": {"summary": {"type": "string"}, "steps": {"type": "array", "items": {"type": "string"}}},
    "required": ["summary", "steps"],
}
JSON_HINT = "\n\nAnswer in JSON with a one-sentence summary and a list of steps."


def engine_configs(quick: bool) -> list[dict]:
    tree_verifiers = ["univer", "greedy", "rrsw", "traversal", "univer_wor", "rrs", "target_only"]
    configs = [
        {"name": "no speculation", "spec": None, "cells": SPEED_CELLS},
        {
            "name": "vLLM draft_model chain k=5",
            "spec": {"method": "draft_model", "num_speculative_tokens": 5, "draft_sample_method": "probabilistic"},
            "cells": SPEED_CELLS,
        },
        {"name": "univer 2x5", "spec": {"method": "univer", "tree": "2x5", "verifier": "univer"}, "cells": SPEED_CELLS},
        {"name": "univer 2x3", "spec": {"method": "univer", "tree": "2x3", "verifier": "univer"}, "cells": SPEED_CELLS},
        *(
            {"name": f"{v} auto", "spec": {"method": "univer", "tree": "auto", "verifier": v}, "cells": SPEED_CELLS}
            for v in ("univer", "traversal")
        ),
        # Only for ``engine_ab.py`` (no cells here): context-aware trees at their default budget.
        {"name": "univer dynamic", "spec": {"method": "univer", "tree": "dynamic", "verifier": "univer"}, "cells": []},
        # Only for ``engine_ab.py``: tree auto with context-aware trees among its candidates (a budget
        # given: max_tree 2x5's depth, 32 nodes, laid on levels 1, 2, 4, 6, 6, 6), cut like the others.
        {
            "name": "univer auto dynamic",
            "spec": {"method": "univer", "tree": "auto", "verifier": "univer", "max_nodes": 32},
            "cells": [],
        },
        # Only for ``engine_ab.py``: tree auto held on plain steps (every depth cut 0, the choice and
        # its measurements still run): what a step costs where auto does not speculate (issue 62).
        {
            "name": "univer auto plain steps",
            "spec": {"method": "univer", "tree": "auto", "verifier": "univer"},
            "env": {SCHEDULE_ENV: "0"},
            "cells": [],
        },
        # Only for ``engine_ab.py`` (no cells here): tree auto as before its depth per temperature band.
        {
            "name": "univer auto one depth",
            "spec": {"method": "univer", "tree": "auto", "verifier": "univer"},
            "env": {ONE_DEPTH_ENV: "1"},
            "cells": [],
        },
    ]
    if not quick:
        configs += [
            {"name": f"{v} 2x5", "spec": {"method": "univer", "tree": "2x5", "verifier": v}, "cells": ACCEPTANCE_CELLS}
            for v in tree_verifiers[1:]
        ]
        configs += [
            {"name": f"{v} 1x5", "spec": {"method": "univer", "tree": "1x5", "verifier": v}, "cells": ACCEPTANCE_CELLS}
            for v in ("token", "block")
        ]
        configs += [
            {**c, "name": f"{c['name']} (JSON)", "cells": JSON_CELLS, "json": True} for c in configs[:2] + configs[3:4]
        ]  # no speculation, vLLM's chain, univer 2x3
    return configs


# ----------------------------------------------------------------- one engine
# The runner's methods timed per cell (``_time_step_parts``): the target forward,
# everything execute_model does (forward included), and sampling plus drafting.
STEP_PARTS = ("_model_forward", "execute_model", "sample_tokens")


def _time_step_parts(worker) -> None:
    """Benchmark hook, every engine alike: wall seconds spent in the runner's
    ``STEP_PARTS`` (on CPU they are synchronous, so their wall time is their work;
    on CUDA it would be launch time only)."""
    runner = worker.model_runner
    totals = runner.__dict__.setdefault(
        "bench_step_seconds", {"steps": 0, "target_tokens": 0, **dict.fromkeys(STEP_PARTS, 0.0)}
    )

    def timed(name: str):
        method = getattr(runner, name)

        def call(*args, **kwargs):
            if name == "_model_forward":  # its query tokens, padding included
                rows = kwargs.get("input_ids", args[0] if args else None)
                rows = kwargs.get("inputs_embeds") if rows is None else rows
                totals["target_tokens"] += 0 if rows is None else rows.shape[0]
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                totals[name] += time.perf_counter() - start
                totals["steps"] += name == "execute_model"

        return call

    for name in STEP_PARTS:
        setattr(runner, name, timed(name))


def _worker_counters(worker) -> dict:
    """In one call: the package's step timers, tree auto's sizer summary, and the
    ``_time_step_parts`` totals (each {} where the engine has none)."""
    runner = worker.model_runner
    univer = getattr(runner, "tree_speculation", None)
    return {
        "timers": dict(univer.timers.totals) if univer is not None else {},
        "sizer": univer.sizer.summary() if univer is not None and univer.sizer is not None else {},
        "step_parts": dict(getattr(runner, "bench_step_seconds", {})),
    }


def _since(after: dict, before: dict) -> dict:
    """Per key, how much a running total grew."""
    return {k: n - before.get(k, 0) for k, n in after.items()}


def timed_cell(llm, texts: list[str], params, one_at_a_time: bool = False) -> dict:
    """One timed ``generate`` of ``texts`` (or one per text, each request alone in the
    engine): tokens/s, and what the engine's counters and the package's timers say
    about the steps it ran."""
    from vllm_univer.tools.spec_counters import spec_counters

    before, worker_before = spec_counters(llm), llm.collective_rpc(_worker_counters)[0]
    start = time.perf_counter()
    if one_at_a_time:
        outputs = [out for text in texts for out in llm.generate([text], params, use_tqdm=False)]
    else:
        outputs = llm.generate(texts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    after, worker_after = spec_counters(llm), llm.collective_rpc(_worker_counters)[0]
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    cell = {"wall_s": wall, "tokens": generated, "tok_per_s": generated / wall}
    if worker_after["step_parts"]:
        cell["step_parts_s"] = _since(worker_after["step_parts"], worker_before["step_parts"])
    if after:
        drafts = after["vllm:spec_decode_num_drafts"] - before.get("vllm:spec_decode_num_drafts", 0)
        accepted = after["vllm:spec_decode_num_accepted_tokens"] - before.get("vllm:spec_decode_num_accepted_tokens", 0)
        per_pos_before = before.get("vllm:spec_decode_num_accepted_tokens_per_pos") or []
        per_pos = [
            a - (per_pos_before[i] if i < len(per_pos_before) else 0)
            for i, a in enumerate(after["vllm:spec_decode_num_accepted_tokens_per_pos"])
        ]
        cell.update(
            steps=drafts,
            tau=1 + accepted / max(drafts, 1),
            accepted_per_depth=[a / max(drafts, 1) for a in per_pos if a] or [0.0],
        )
    sizer_before, sizer_after = worker_before["sizer"], worker_after["sizer"]
    for key in ("requests_at_depth", "requests_at_width", "requests_at_cut"):  # tree auto: request-steps per cut
        if sizer_after.get(key):
            cell[key] = _since(sizer_after[key], sizer_before.get(key, {}))
    if sizer_after:  # what the choice knew at the end of the run: why it drafted what it drafted
        cell["sizer_state"] = {k: sizer_after[k] for k in ("hazards", "evidence", "cost_correction")}
    if worker_after["timers"]:
        spent = _since(worker_after["timers"], worker_before["timers"])
        outside = spent.get("verify", 0.0) + spent.get("draft", 0.0) - spent.get("draft_forward", 0.0)
        cell.update(timers=spent, overhead_share=outside / wall)
    return cell


class Engine:
    """One row's engine in this process (``run_one_engine``, ``serve_one_engine``):
    the LLM with the step-part timers on, its prompts as chat texts, warmed up."""

    def __init__(self, job: dict):
        from vllm import LLM, SamplingParams

        spec = job["spec"]
        if spec is not None:
            spec = {**spec, "model": job["draft"]}
        self.job = job
        self.llm = LLM(
            model=job["target"],
            speculative_config=spec,
            dtype=serving_dtype()[0],
            enforce_eager=True,
            max_model_len=2048,
            max_num_seqs=MAX_BATCH,
            seed=0,
            disable_log_stats=False,
        )
        self.llm.collective_rpc(_time_step_parts)
        tokenizer = self.llm.get_tokenizer()
        self.structured = {}
        if job.get("json"):
            from vllm.sampling_params import StructuredOutputsParams

            self.structured = {"structured_outputs": StructuredOutputsParams(json=JSON_SCHEMA), "ignore_eos": False}
        self.texts = {
            dataset: [
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": t + (JSON_HINT if self.structured else "")}],
                    tokenize=False,
                    add_generation_prompt=True,
                )
                for t in prompts
            ]
            for dataset, prompts in job["prompts"].items()
        }
        # Warm-up: a short generate at every batch size of the matrix, so that no timed
        # cell pays for first-time work at its shapes (oneDNN primitives, allocations).
        warm_up = SamplingParams(max_tokens=8, temperature=0)
        for batch in sorted({c[0] for c in job["cells"]}):
            self.llm.generate(self.texts["mtbench"][:batch], warm_up, use_tqdm=False)

    def timed_runs(self, cell: list | tuple, repeats: int) -> list[dict]:
        """``repeats`` timed runs of one cell (batch, temperature, new tokens, prompt set)."""
        from vllm import SamplingParams

        batch, temperature, new_tokens, dataset = cell
        # A list of temperatures: one per request in turn (a batch of mixed sampling parameters).
        temperatures = temperature if isinstance(temperature, list) else [temperature]
        params = [
            SamplingParams(
                **{"temperature": t, "max_tokens": new_tokens, "ignore_eos": True, "seed": None, **self.structured}
            )
            for t in temperatures
        ]
        params = params[0] if len(params) == 1 else [params[i % len(params)] for i in range(batch)]
        # At batch 1 a run takes ``single_prompts`` prompts one request at a time, so that
        # one prompt's luck does not decide the cell.
        prompts = self.texts[dataset][: self.job["single_prompts"] if batch == 1 else batch]
        return [timed_cell(self.llm, prompts, params, one_at_a_time=batch == 1) for _ in range(repeats)]


def run_one_engine(job: dict) -> dict:
    """``--one``: every cell of the job, each the fastest of its repeats."""
    engine = Engine(job)
    cells = []
    for batch, temperature, new_tokens, dataset in job["cells"]:
        # The best of a few runs: this machine's speed drifts by tens of percent within minutes.
        # One request of 64 tokens is the noisiest cell (a few steps; at T = 1 the draws decide
        # tau) and the cheapest to repeat.
        repeats = job["repeats"] if batch > 1 else job["single_repeats"]
        runs = engine.timed_runs((batch, temperature, new_tokens, dataset), repeats)
        cell = max(runs, key=lambda run: run["tok_per_s"])
        cells.append(
            {
                "dataset": dataset,
                "batch": batch,
                "temperature": temperature,
                "new_tokens": new_tokens,
                **cell,
                "tok_per_s_runs": [run["tok_per_s"] for run in runs],
            }
        )
    return {"name": job["name"], "cells": cells}


def serve_one_engine(job: dict) -> None:
    """``--serve``: start the job's engine, answer ``{"ready": true}``, then one timed
    run per cell read from stdin (one JSON line each), until stdin closes: engines of
    several rows alive at once, their runs interleaved (``engine_ab.py --interleave``)."""
    engine = Engine(job)
    print_result({"ready": True})
    for line in sys.stdin:
        print_result(engine.timed_runs(json.loads(line), 1)[0])


# ---------------------------------------------------------------- the matrix
def engine_job(
    config: dict,
    cells: list,
    target: str,
    draft: str,
    texts: dict,
    repeats: int,
    single_repeats: int,
    single_prompts: int = 1,
):
    """What ``run_one_engine`` runs (``--one``, in its own process): one row of ``engine_configs`` on ``cells``."""
    return {
        "name": config["name"],
        "spec": config["spec"],
        "cells": cells,
        "target": target,
        "draft": draft,
        "prompts": texts,
        "json": config.get("json", False),
        "env": config.get("env", {}),
        "repeats": repeats,
        "single_repeats": single_repeats,
        "single_prompts": single_prompts,
    }


def run_matrix(args) -> list[dict]:
    from vllm_univer.tools.real_models import DEFAULT_DRAFT, DEFAULT_TARGET, model_dir, prompts

    target, draft = str(model_dir(DEFAULT_TARGET)), str(model_dir(DEFAULT_DRAFT))
    texts = {
        dataset: [p["turns"][0] for p in prompts(dataset, limit=MAX_BATCH)] for dataset in ("mtbench", "humaneval")
    }
    out_json = RESULTS / f"{results_stem(args)}.json"
    done = {}
    if out_json.exists() and not args.fresh:
        done = {r["name"]: r for r in json.loads(out_json.read_text())["engines"]}
    jobs = {}  # row name -> its engine job, in the matrix's order
    speed_rows = []  # the rows of the speed matrix among them
    for config in engine_configs(args.quick):
        if config["name"] in done and config["name"] not in args.rerun:
            continue
        cells = [c for c in config["cells"] if not args.quick or (c[0] == 8 and c[3] == "mtbench")]
        if cells:
            jobs[config["name"]] = engine_job(
                config, cells, target, draft, texts, args.repeats, args.single_repeats, args.single_prompts
            )
            if config["cells"] is SPEED_CELLS:
                speed_rows.append(config["name"])
    # Round 0 runs every row in the matrix's order; later rounds run the speed rows
    # again, each round in the opposite order to the one before (drift cancels in the mean).
    schedule = [(0, name) for name in jobs]
    for r in range(1, args.rounds):
        schedule += [(r, name) for name in (speed_rows[::-1] if r % 2 else speed_rows)]
    engines: dict[str, list[dict]] = {}
    for r, name in schedule:
        job = jobs[name]
        print(f"[engine] {name} (round {r}) ...", flush=True)
        result, stderr = run_json_job(["-m", "benchmarks.engine", "--one"], job, {**os.environ, **ENV, **job["env"]})
        if result is None:
            raise RuntimeError(f"{name} failed:\n{stderr[-5000:]}")
        engines.setdefault(name, []).append(result)
        print(json.dumps(result["cells"]), flush=True)
        done[name] = merge_rounds(engines[name])
        _write_matrix(out_json, done)
    _write_matrix(out_json, done)
    order = [c["name"] for c in engine_configs(args.quick)]
    return sorted(done.values(), key=lambda r: order.index(r["name"]) if r["name"] in order else len(order))


def _write_matrix(path: Path, rows: dict[str, dict]) -> None:
    path.write_text(json.dumps({"engines": list(rows.values()), "command": " ".join(sys.argv)}, indent=1))


def merge_rounds(engines: list[dict]) -> dict:
    """One row from the R engines that ran it (``--rounds``), cell by cell: tokens/s
    is the mean over engines (each the fastest of its repeats; per engine in
    ``tok_per_s_rounds``), steps and counts are pooled (tau and acceptance per depth
    over every step), shares averaged. One engine: its row unchanged."""
    if len(engines) == 1:
        return engines[0]
    cells = []
    for per_round in zip(*(e["cells"] for e in engines), strict=True):
        cell = dict(per_round[-1])
        cell["tok_per_s_rounds"] = [c["tok_per_s"] for c in per_round]
        cell["tok_per_s"] = statistics.fmean(cell["tok_per_s_rounds"])
        cell["tok_per_s_runs"] = [t for c in per_round for t in c.get("tok_per_s_runs", [c["tok_per_s"]])]
        for key in ("wall_s", "tokens"):
            cell[key] = sum(c[key] for c in per_round)
        if "tau" in cell:
            steps = [c["steps"] for c in per_round]
            cell["steps"] = sum(steps)
            cell["tau"] = 1 + sum((c["tau"] - 1) * n for c, n in zip(per_round, steps)) / max(cell["steps"], 1)
            depths = max(len(c["accepted_per_depth"]) for c in per_round)
            cell["accepted_per_depth"] = [
                sum(n * (c["accepted_per_depth"] + [0.0] * depths)[d] for c, n in zip(per_round, steps))
                / max(cell["steps"], 1)
                for d in range(depths)
            ]
        for key in ("requests_at_depth", "requests_at_width", "requests_at_cut", "timers", "step_parts_s"):
            if key in cell:
                total: dict = {}
                for c in per_round:
                    for k, n in c.get(key, {}).items():
                        total[k] = total.get(k, 0) + n
                cell[key] = total
        if "overhead_share" in cell:
            cell["overhead_share"] = statistics.fmean(c["overhead_share"] for c in per_round)
        cells.append(cell)
    return {"name": engines[0]["name"], "cells": cells, "rounds": len(engines)}


def results_stem(args) -> str:
    return "engine" + ("_quick" if args.quick else "") + (f"_{args.tag}" if args.tag else "")


def device_label() -> str:
    import torch

    if torch.cuda.is_available():
        return f"CUDA build, {torch.cuda.get_device_name()}"
    from vllm_univer.tools.host_cpu import host_cpu

    return f"CPU build, {host_cpu().label}, {platform.platform()}"


def tau_standard_error(cell: dict) -> float:
    """Standard error of tau from the per-depth acceptance rates a_d = P(k >= d):
    E[k] = sum a_d, E[k^2] = sum (2d - 1) a_d (steps treated as independent)."""
    rates = cell.get("accepted_per_depth", [])
    mean = sum(rates)
    second = sum((2 * d - 1) * a for d, a in enumerate(rates, start=1))
    return max(second - mean * mean, 0.0) ** 0.5 / max(cell.get("steps", 1), 1) ** 0.5


def report(results: list[dict], command: str) -> str:
    # Each row is compared with the row without speculation of the same kind (plain or JSON).
    def kind(r):
        return r["name"].endswith("(JSON)")

    base = {
        (kind(r), *cell_key(c)): c["tok_per_s"]
        for r in results
        if r["name"].startswith("no speculation")
        for c in r["cells"]
    }
    lines = [
        "# Tree speculation through vLLM 0.32: speed and acceptance",
        "",
        f"Command: `{command}`. Machine: {device_label()}; Qwen2.5-Coder 1.5B target / 0.5B draft, "
        f"{serving_dtype()[0]}, "
        "enforce_eager, MT-Bench or HumanEval prompts (chat template), ignore_eos. One engine per row, one process per "
        "engine, one engine at a time. Rows are saved in the JSON file beside this one; `--rerun NAME...` "
        "replaces the named rows. What each session read from these tables: "
        "[engine_observations.md](engine_observations.md).",
        "",
        "tok/s: wall clock of `generate`, the fastest of the timed runs per cell (`--repeats`, 2 unless said; "
        "at batch 1 `--single-repeats`, 4 unless said, each run one prompt, or `--single-prompts` prompts "
        "one request at a time; "
        "every run in the JSON file), after a warm-up generate at every batch size. "
        + _rounds_sentence(results)
        + "tau = mean tokens per step = 1 + accepted / drafts (vLLM's spec-decode counters), +- its standard "
        "error (steps treated as independent). "
        "'outside forwards' = share of wall time in tree bookkeeping, verification and KV moves "
        "(everything the package adds except the target and draft forward passes). "
        "`auto` rows: tree 'auto' (max_tree 2x5); 'depth cuts' = share of request-steps drafted at depth 0 / 1 / ... "
        "(0: no speculation); 'width 1 / 2' = share of the speculating request-steps drafted with the chain 1x5 "
        "(width cut 1) and with the whole 2x5.",
        "",
        "| engine | prompts | batch | T | new tokens | tok/s | vs no spec | tau | accepted per depth "
        "| outside forwards |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for c in r["cells"]:
            key = (kind(r), *cell_key(c))
            ratio = c["tok_per_s"] / base[key] if key in base else float("nan")
            tau = f"{c['tau']:.2f} +- {tau_standard_error(c):.2f}" if "tau" in c else "-"
            depth = " / ".join(f"{a:.2f}" for a in c.get("accepted_per_depth", [])) or "-"
            share = f"{100 * c['overhead_share']:.1f}%" if "overhead_share" in c else "-"
            if "requests_at_depth" in c:
                total = max(sum(c["requests_at_depth"].values()), 1)
                cuts = " / ".join(f"{100 * n / total:.0f}%" for _, n in sorted(c["requests_at_depth"].items()))
                depth = f"{depth}; depth cuts {cuts}"
            if c.get("requests_at_width"):
                total = max(sum(c["requests_at_width"].values()), 1)
                widths = " / ".join(f"{100 * n / total:.0f}%" for _, n in sorted(c["requests_at_width"].items()))
                depth = f"{depth}; width {' / '.join(str(w) for w in sorted(c['requests_at_width']))}: {widths}"
            speed = f"{c['tok_per_s']:.2f}"
            if len(c.get("tok_per_s_rounds", [])) > 1:
                speed += " (" + " / ".join(f"{t:.2f}" for t in c["tok_per_s_rounds"]) + ")"
            lines.append(
                f"| {r['name']} | {cell_key(c)[0]} | {c['batch']} | {c['temperature']:g} | {c['new_tokens']} | "
                f"{speed} | {ratio:.2f}x | {tau} | {depth} | {share} |"
            )
    return "\n".join(lines + offline_agreement(results) + auto_goal(results)) + "\n"


def _rounds_sentence(results: list[dict]) -> str:
    rounds = {r["name"]: r["rounds"] for r in results if r.get("rounds", 1) > 1}
    if not rounds:
        return ""
    names = ", ".join(f"{name} ({n})" for name, n in rounds.items())
    return (
        f"Rows run in rounds (`--rounds`, each round a fresh engine per row, the rows in the opposite order to the "
        f"round before): {names}; their tok/s is the mean over rounds of each engine's fastest run (per round in "
        "brackets), tau and acceptance pooled over every step. "
    )


def cell_key(cell: dict) -> tuple[str, int, float]:
    """(prompt set, batch, temperature) of a matrix cell (rows of earlier runs: MT-Bench)."""
    return cell.get("dataset", "mtbench"), cell["batch"], cell["temperature"]


def auto_goal(results: list[dict]) -> list[str]:
    """The worst matrix cell of tree 'auto' against the best other row there, and against
    no speculation: on each row's fastest run per cell (the table), then on the median run;
    per auto row, then the goal's line (the better auto row per cell), last."""
    fastest = _auto_goal(results, lambda c: c["tok_per_s"], "AUTO worst cell", "the table's run")
    # At T = 1 the fastest of a few runs is partly the luckiest draw: a row with more
    # variable steps (a long chain) gains most from it. The median run is the typical one.
    median = _auto_goal(
        results,
        lambda c: statistics.median(c.get("tok_per_s_runs") or [c["tok_per_s"]]),
        "(median run per cell)",
        "median run",
    )
    if fastest is None:
        return []
    lines = [fastest[0], *(median or ()), fastest[1]]
    return [line for text in lines for line in ("", text)]


def _auto_goal(results: list[dict], speed, label: str, runs: str) -> tuple[str, str] | None:
    """(per auto row, the goal's line), the goal taking the better auto row per cell."""
    cells: dict[tuple, dict[str, float]] = {}
    for r in results:
        if r["name"].endswith("(JSON)"):
            continue
        for c in r["cells"]:
            cells.setdefault(cell_key(c), {})[r["name"]] = speed(c)
    worst: dict[str, list[float]] = {}  # auto row (or "auto": the better per cell) -> [vs best other, vs none]
    for rows in cells.values():
        autos = {n: v for n, v in rows.items() if n.endswith(" auto")}
        others = {n: v for n, v in rows.items() if not n.endswith(" auto")}
        if not autos or not others or "no speculation" not in rows:
            continue
        for name, value in [*autos.items(), ("auto", max(autos.values()))]:
            ratios = (value / max(others.values()), value / rows["no speculation"])
            worst[name] = [min(a, b) for a, b in zip(worst.get(name, [float("inf")] * 2), ratios)]
    if "auto" not in worst:
        return None
    per_row = "; ".join(f"{n} {w[0]:.2f}x / {w[1]:.2f}x" for n, w in worst.items() if n != "auto")
    best, plain = worst["auto"]
    return (
        f"Per auto row ({runs} per cell), worst cell against the best other row / against no speculation: {per_row}.",
        f"{label}: auto / best other = {best:.2f}x; auto / no speculation >= {plain:.2f}x",
    )


def offline_agreement(results: list[dict], tree: str = "2x5", temperature: float = 1.0) -> list[str]:
    """tau of each verifier through vLLM (batch 8) against the offline acceptance study
    (``acceptance.py``: exact expected tau per drafted tree, MT-Bench contexts)."""
    records = RESULTS / "acceptance.jsonl"
    if not records.exists():
        return []
    from benchmarks.acceptance import mean_and_se, study_records

    offline: dict[str, list[float]] = {}
    for r in study_records(records)[1]:
        if r["dataset"] == "mtbench" and r["tree"] == tree and r["temperature"] == temperature:
            offline.setdefault(r["method"], []).append(r["accepted"] + 1.0)
    lines = [
        "",
        f"## tau through vLLM against the offline acceptance study (MT-Bench, tree {tree}, T = {temperature:g})",
        "",
        "Offline: `benchmarks/results/acceptance.md` (exact expected tau per drafted tree, its own "
        "MT-Bench contexts). Through vLLM: the batch-8 rows above (sampled steps, the engine's own "
        "continuations). z = difference / sqrt(SE_vLLM^2 + SE_offline^2).",
        "",
        "| verifier | through vLLM | offline study | difference | z |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        method = r["name"].removesuffix(f" {tree}")
        cell = next((c for c in r["cells"] if cell_key(c) == ("mtbench", 8, temperature) and "tau" in c), None)
        values = offline.get(method)
        if r["name"] == method or cell is None or not values or len(values) < 2:
            continue
        mean, se = mean_and_se(values)
        diff, engine_se = cell["tau"] - mean, tau_standard_error(cell)
        lines.append(
            f"| {method} | {cell['tau']:.2f} +- {engine_se:.2f} | {mean:.2f} +- {se:.2f} | {diff:+.2f} | "
            f"{diff / (engine_se**2 + se**2) ** 0.5:+.1f} |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--fresh", action="store_true", help="ignore saved engines and rerun all")
    ap.add_argument(
        "--rerun",
        nargs="+",
        default=[],
        metavar="NAME",
        help="rerun these engines (by row name, e.g. 'univer 2x5') and keep the other saved rows",
    )
    ap.add_argument("--tag", default="", help="suffix of the results files (e.g. 'gpu')")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per cell; the fastest is reported")
    ap.add_argument(
        "--single-repeats", type=int, default=4, help="timed runs per batch-1 cell (one request); the fastest counts"
    )
    ap.add_argument(
        "--single-prompts",
        type=int,
        default=1,
        help="prompts per batch-1 run, one request at a time (tokens/s over all of them)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the speed rows this many times, alternating their order; a cell's tok/s is the mean over rounds",
    )
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print_result(run_one_engine(json.load(sys.stdin)))
        return
    if args.serve:
        serve_one_engine(json.loads(sys.stdin.readline()))
        return
    results = run_matrix(args)
    command = (
        "python -m benchmarks.engine"
        + (" --quick" if args.quick else "")
        + (f" --tag {args.tag}" if args.tag else "")
        + (f" --repeats {args.repeats}" if args.repeats != 2 else "")
        + (f" --single-repeats {args.single_repeats}" if args.single_repeats != 4 else "")
        + (f" --single-prompts {args.single_prompts}" if args.single_prompts != 1 else "")
        + (f" --rounds {args.rounds}" if args.rounds != 1 else "")
    )
    text = report(results, command)
    out_md = RESULTS / f"{results_stem(args)}.md"
    out_md.write_text(text)  # observations: engine_observations.md, written by hand
    print(text)


if __name__ == "__main__":
    main()
