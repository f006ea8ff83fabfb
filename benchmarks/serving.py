"""Serving benchmark through vLLM's own client: ``vllm bench serve`` (the tool vLLM
users benchmark with) against a real ``vllm serve`` per configuration, one server
at a time, the same requests for each.

Configurations: no speculation, vLLM's ``draft_model`` chain (k = 3 and 5), and
this package's ``tree: auto`` (UniVer); every server gets the main job's settings
for the machine (``tools.serving_defaults``). Load: Poisson request rates (open
loop) and a concurrency sweep (closed loop, rate unbounded), MT-Bench prompts
through the chat endpoint, a fixed output length (ignore_eos). Reported: output
tokens/s, TTFT / TPOT / ITL p50 and p99, and each row's ratio to no speculation.

    pip install -e '.[serve-bench]'                       # what `vllm bench serve` imports
    python -m benchmarks.serving                          # the whole matrix (hours on a 2-core CPU)
    python -m benchmarks.serving --rates 2 --concurrency 1 4 --configs nospec auto --datasets mtbench

The results end with one line: ``SERVING worst load: auto / plain = X.XXx (LOAD);
concurrency 1: Y.YYx; auto / best vLLM chain >= Z.ZZx; ITL p99 <= W.WWx plain``.
Results: ``benchmarks/results/serving.md`` and ``serving.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from vllm_univer.tools.local_server import vllm_executable, vllm_serve
from vllm_univer.tools.serving_defaults import LOCAL_SERVER_ENV, hardware_defaults

RESULTS = Path(__file__).resolve().parent / "results"
SERVED_NAME = "target"

CONFIGS = {
    "nospec": None,
    "chain k=3": {"method": "draft_model", "num_speculative_tokens": 3},
    "chain k=5": {"method": "draft_model", "num_speculative_tokens": 5},
    "auto": {"method": "univer", "tree": "auto", "verifier": "univer"},
    "univer 2x3": {"method": "univer", "tree": "2x3", "verifier": "univer"},
}
METRICS = ("ttft", "tpot", "itl")


def server_args(target: str, draft: str, spec: dict | None, dtype: str, engine_args: list[str]) -> list[str]:
    args = [target, "--served-model-name", SERVED_NAME, "--dtype", dtype, "--max-model-len", "2048"]
    args += ["--max-num-seqs", "16", "--seed", "0", *engine_args]
    if spec is not None:
        args += ["--speculative-config", json.dumps({**spec, "model": draft})]
    return args


def bench_serve(url: str, tokenizer: str, dataset: Path, load: dict, args, out_dir: Path) -> dict:
    """One ``vllm bench serve`` run; its saved JSON result."""
    name = f"run_{time.monotonic_ns()}.json"
    cmd = [
        vllm_executable(),
        "bench",
        "serve",
        "--backend",
        "openai-chat",
        "--endpoint",
        "/v1/chat/completions",
        "--base-url",
        url,
        "--model",
        SERVED_NAME,
        "--tokenizer",
        tokenizer,
        "--dataset-name",
        "custom",
        "--dataset-path",
        str(dataset),
        "--skip-chat-template",  # the chat endpoint applies the server's template
        "--custom-output-len",
        str(args.output_len),
        "--num-prompts",
        str(args.requests),
        "--ignore-eos",
        "--temperature",
        str(args.temperature),
        "--percentile-metrics",
        ",".join(METRICS),
        "--metric-percentiles",
        "50,99",
        "--seed",
        "0",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(out_dir),
        "--result-filename",
        name,
        "--request-rate",
        str(load["rate"]),
    ]
    if load.get("concurrency"):
        cmd += ["--max-concurrency", str(load["concurrency"])]
    subprocess.run(cmd, check=True, env={**os.environ, **LOCAL_SERVER_ENV}, stdout=subprocess.DEVNULL)
    return json.loads((out_dir / name).read_text())


def row_of(result: dict) -> dict:
    row = {"tok_per_s": result["output_throughput"], "completed": result.get("completed")}
    for metric in METRICS:
        for p in (50, 99):
            row[f"{metric}_p{p}"] = result.get(f"p{p}_{metric}_ms")
    return row


def loads_of(args) -> list[dict]:
    return [{"rate": r, "concurrency": None} for r in args.rates] + [
        {"rate": "inf", "concurrency": c} for c in args.concurrency
    ]


def label(load: dict) -> str:
    return f"concurrency {load['concurrency']}" if load["concurrency"] else f"Poisson {load['rate']} req/s"


def report(results: dict, args, hardware: str) -> str:
    """The table (per dataset, config and load: medians over the repeats; ratios paired
    by repeat, against no speculation under the same load) and the SERVING line."""
    lines = [
        "# Serving benchmark: `vllm bench serve` against `vllm serve`",
        "",
        f"Command: `python -m benchmarks.serving {' '.join(sys.argv[1:])}`. Machine: {hardware}; "
        f"{platform.platform()}. Qwen2.5-Coder 1.5B target / 0.5B draft, {args.requests} requests per load "
        f"and dataset (MT-Bench: chat endpoint, HumanEval: the same, its prompts as user turns), "
        f"{args.output_len} output tokens (ignore_eos), temperature {args.temperature}. One server at a time; "
        f"{args.repeats} repeat(s), the configurations in turn (reversed every other repeat); a ratio pairs "
        "two configurations' runs of one repeat: mean (min .. max) over the repeats. Times in ms, medians "
        "over the repeats.",
        "",
        "| dataset | config | load | tok/s | vs no spec | TPOT p99 vs no spec | ITL p99 vs no spec "
        "| TTFT p50 / p99 | TPOT p50 / p99 | ITL p50 / p99 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    summary = {}
    for dataset, by_config in results.items():
        for name, by_load in by_config.items():
            for key, runs in by_load.items():
                base = by_config.get("nospec", {}).get(key)
                cells = []
                for field in ("tok_per_s", "tpot_p99", "itl_p99"):
                    if base is None or not all(b.get(field) and r.get(field) for b, r in zip(base, runs)):
                        cells.append("-")
                        continue
                    ratio = [r[field] / b[field] for b, r in zip(base, runs)]
                    summary.setdefault((name, field), []).append((float(np.mean(ratio)), dataset, key))
                    cells.append(f"{np.mean(ratio):.2f}x ({min(ratio):.2f} .. {max(ratio):.2f})")
                times = [
                    " / ".join(
                        "-"
                        if any(r[f"{m}_p{p}"] is None for r in runs)
                        else f"{np.median([r[f'{m}_p{p}'] for r in runs]):.0f}"
                        for p in (50, 99)
                    )
                    for m in METRICS
                ]
                tok = np.median([r["tok_per_s"] for r in runs])
                lines.append(f"| {dataset} | {name} | {key} | {tok:.2f} | " + " | ".join(cells + times) + " |")
    lines += ["", serving_line(summary, results)]
    return "\n".join(lines) + "\n"


def serving_line(summary: dict, results: dict) -> str:
    """SERVING worst load: auto / plain = X.XXx (LOAD); concurrency 1: Y.YYx; auto / best vLLM chain >= Z.ZZx;
    ITL p99 <= W.WWx plain (ratios as in the table; '-' where a configuration did not run)."""
    auto = summary.get(("auto", "tok_per_s"), [])
    if not auto:
        return "SERVING worst load: - (auto did not run against nospec)"
    worst = min(auto)
    single = [r for r, _, key in auto if key == "concurrency 1"]
    chains = []
    for by_config in results.values():
        for key, runs in by_config.get("auto", {}).items():
            best = (
                [
                    max(
                        by_config[c][key][i]["tok_per_s"]
                        for c in by_config
                        if c.startswith("chain") and key in by_config[c]
                    )
                    for i in range(len(runs))
                ]
                if any(c.startswith("chain") for c in by_config)
                else None
            )
            if best:
                chains.append(float(np.mean([r["tok_per_s"] / b for r, b in zip(runs, best)])))
    itl = max((r for r, _, _ in summary.get(("auto", "itl_p99"), [])), default=float("nan"))
    return (
        f"SERVING worst load: auto / plain = {worst[0]:.2f}x ({worst[1]}, {worst[2]}); concurrency 1: "
        + (" / ".join(f"{r:.2f}x" for r in single) if single else "-")
        + (f"; auto / best vLLM chain >= {min(chains):.2f}x" if chains else "; auto / best vLLM chain: -")
        + f"; ITL p99 <= {itl:.2f}x plain"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["nospec", "chain k=3", "chain k=5", "auto"], choices=CONFIGS)
    ap.add_argument("--rates", nargs="*", type=float, default=[0.5, 1.0, 2.0, 4.0])
    ap.add_argument("--concurrency", nargs="*", type=int, default=[1, 2, 4, 8, 16])
    ap.add_argument("--datasets", nargs="+", default=["mtbench", "humaneval"], choices=["mtbench", "humaneval"])
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=2, help="each configuration's server this many times, in turn")
    ap.add_argument("--out", default="serving", help="results/OUT.md and .json")
    ap.add_argument("--report", metavar="JSON", help="only write the report of a saved run")
    args = ap.parse_args()
    if args.report:
        record = json.loads(Path(args.report).read_text())
        saved = argparse.Namespace(**record["args"])
        sys.argv = record["command"]
        text = report(record["results"], saved, record["hardware"])
        (RESULTS / f"{saved.out}.md").write_text(text)
        print(text)
        return
    missing = [name for name in ("pandas", "datasets") if importlib.util.find_spec(name) is None]
    if missing:  # `vllm bench serve` imports them; fail here, before the first server starts
        sys.exit(f"`vllm bench serve` needs {', '.join(missing)}: pip install -e '.[serve-bench]'")

    from vllm_univer.tools.real_models import DEFAULT_DRAFT, DEFAULT_TARGET, model_dir, prompts

    target, draft = str(model_dir(DEFAULT_TARGET)), str(model_dir(DEFAULT_DRAFT))
    dtype, hardware, engine_args, hardware_env = hardware_defaults([])
    work = Path(tempfile.mkdtemp(prefix="vllm_univer_serving_"))
    datasets = {}
    for name in args.datasets:
        datasets[name] = work / f"{name}.jsonl"
        items = prompts(name, limit=args.requests)
        datasets[name].write_text("".join(json.dumps({"prompt": p["turns"][0]}) + "\n" for p in items))
    # results[dataset][config][load label] = one row per repeat
    results: dict[str, dict[str, dict[str, list]]] = {d: {c: {} for c in args.configs} for d in args.datasets}
    for repeat in range(args.repeats):
        for name in args.configs if repeat % 2 == 0 else args.configs[::-1]:
            print(f"[serving] repeat {repeat + 1}: {name} ...", flush=True)
            log = work / f"{name.replace(' ', '_')}_{repeat}.log"
            env = {**hardware_env, **os.environ, **LOCAL_SERVER_ENV}
            server = server_args(target, draft, CONFIGS[name], dtype, engine_args)
            with vllm_serve(server, env, timeout=900, log_path=log, grace=60) as (_, url):
                for dataset, path in datasets.items():
                    for load in loads_of(args):
                        row = {"load": load, **row_of(bench_serve(url, target, path, load, args, work))}
                        results[dataset][name].setdefault(label(load), []).append(row)
                        print(f"[serving] {dataset} {name} {label(load)}: {row['tok_per_s']:.2f} tok/s", flush=True)
            record = {"command": sys.argv, "hardware": hardware, "args": vars(args), "results": results}
            (RESULTS / f"{args.out}.json").write_text(json.dumps(record, indent=1))
    text = report(results, args, hardware)
    (RESULTS / f"{args.out}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
