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
    python -m benchmarks.serving                          # default matrix
    python -m benchmarks.serving --rates 1 --concurrency 1 4 --configs nospec auto
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
    lines = [
        "# Serving benchmark: `vllm bench serve` against `vllm serve`",
        "",
        f"Command: `python -m benchmarks.serving {' '.join(sys.argv[1:])}`. Machine: {hardware}; "
        f"{platform.platform()}. Qwen2.5-Coder 1.5B target / 0.5B draft, MT-Bench prompts (chat endpoint), "
        f"{args.requests} requests per load, {args.output_len} output tokens (ignore_eos), temperature "
        f"{args.temperature}. One server at a time, every row from this run; ratios against no speculation "
        "under the same load. Times in ms.",
        "",
        "| config | load | tok/s | vs no spec | TTFT p50 / p99 | TPOT p50 / p99 | ITL p50 / p99 |",
        "|---|---|---|---|---|---|---|",
    ]
    base = {label(r["load"]): r for r in results.get("nospec", [])}
    for name, rows in results.items():
        for r in rows:
            b = base.get(label(r["load"]))
            ratio = f"{r['tok_per_s'] / b['tok_per_s']:.2f}x" if b else "-"
            cells = [
                " / ".join("-" if r[f"{m}_p{p}"] is None else f"{r[f'{m}_p{p}']:.0f}" for p in (50, 99))
                for m in METRICS
            ]
            head = f"| {name} | {label(r['load'])} | {r['tok_per_s']:.2f} | {ratio} | "
            lines.append(head + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["nospec", "chain k=3", "chain k=5", "auto"], choices=CONFIGS)
    ap.add_argument("--rates", nargs="*", type=float, default=[0.5, 2.0])
    ap.add_argument("--concurrency", nargs="*", type=int, default=[1, 4])
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--out", default="serving", help="results/OUT.md and .json")
    args = ap.parse_args()
    missing = [name for name in ("pandas", "datasets") if importlib.util.find_spec(name) is None]
    if missing:  # `vllm bench serve` imports them; fail here, before the first server starts
        sys.exit(f"`vllm bench serve` needs {', '.join(missing)}: pip install -e '.[serve-bench]'")

    from vllm_univer.tools.real_models import DEFAULT_DRAFT, DEFAULT_TARGET, model_dir, prompts

    target, draft = str(model_dir(DEFAULT_TARGET)), str(model_dir(DEFAULT_DRAFT))
    dtype, hardware, engine_args, hardware_env = hardware_defaults([])
    work = Path(tempfile.mkdtemp(prefix="vllm_univer_serving_"))
    dataset = work / "mtbench.jsonl"
    items = prompts("mtbench", limit=args.requests)
    dataset.write_text("".join(json.dumps({"prompt": p["turns"][0]}) + "\n" for p in items))
    results: dict[str, list] = {}
    for name in args.configs:
        print(f"[serving] {name} ...", flush=True)
        log = work / f"{name.replace(' ', '_')}.log"
        env = {**hardware_env, **os.environ, **LOCAL_SERVER_ENV}
        server = server_args(target, draft, CONFIGS[name], dtype, engine_args)
        with vllm_serve(server, env, timeout=900, log_path=log, grace=60) as (_, url):
            results[name] = []
            for load in loads_of(args):
                row = {"load": load, **row_of(bench_serve(url, target, dataset, load, args, work))}
                results[name].append(row)
                print(f"[serving] {name} {label(load)}: {row['tok_per_s']:.2f} tok/s", flush=True)
        record = {"command": sys.argv, "hardware": hardware, "args": vars(args), "results": results}
        (RESULTS / f"{args.out}.json").write_text(json.dumps(record, indent=1))
    text = report(results, args, hardware)
    (RESULTS / f"{args.out}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
