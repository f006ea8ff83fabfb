"""Serving benchmark: a real ``vllm serve`` per configuration, driven by an
``openai``-client load generator (Poisson arrivals), side by side on the same prompts.

Configurations: no speculation, vLLM's ``draft_model`` chain (k = 5), and
``univer`` with several verifiers. For each request rate the same requests
(MT-Bench prompts, chat template, fixed output length, ignore_eos) are sent;
the script records output tokens/s over the run, TTFT and TPOT (p50 / p99), and
their ratios to no speculation. One server runs at a time.

    python benchmarks/serving.py                      # default matrix (about 20 min on 2 cores)
    python benchmarks/serving.py --rates 1 4 --requests 8 --configs nospec univer
Results: ``benchmarks/results/serving.md`` and ``serving.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from vllm_univer.tools.host_cpu import host_cpu
from vllm_univer.tools.local_server import vllm_serve

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))

CONFIGS = {
    "nospec": None,
    "chain": {"method": "draft_model", "num_speculative_tokens": 5, "draft_sample_method": "probabilistic"},
    "univer": {"method": "univer", "tree": "2x3", "verifier": "univer"},
    "greedy": {"method": "univer", "tree": "2x3", "verifier": "greedy"},
    "rrsw": {"method": "univer", "tree": "2x3", "verifier": "rrsw"},
    "traversal": {"method": "univer", "tree": "2x3", "verifier": "traversal"},
}


def server_args(target: str, draft: str, spec: dict | None) -> list[str]:
    args = [target, "--served-model-name", "target", "--dtype", serving_dtype(), "--enforce-eager"]
    args += ["--max-model-len", "2048", "--max-num-seqs", "16", "--seed", "0"]
    if spec is not None:
        args += ["--speculative-config", json.dumps({**spec, "model": draft})]
    return args


def serving_dtype() -> str:
    return host_cpu().serving_dtype()[0]


SERVER_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "4"}


async def one_request(client, prompt: str, max_tokens: int, temperature: float, delay: float) -> dict:
    await asyncio.sleep(delay)
    start = time.perf_counter()
    first, chunks = None, 0
    stream = await client.chat.completions.create(
        model="target",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=temperature,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    tokens = 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            chunks += 1
            if first is None:
                first = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    ttft = (first or end) - start
    return {
        "start": start,
        "end": end,
        "ttft": ttft,
        "tpot": (end - (first or end)) / max(tokens - 1, 1),
        "tokens": tokens,
    }


async def drive(url: str, prompts: list[str], rate: float, max_tokens: int, temperature: float) -> dict:
    import openai

    rng = random.Random(0)
    delays, t = [], 0.0
    for _ in prompts:
        delays.append(t)
        t += rng.expovariate(rate)
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=3600, max_retries=0) as client:
        rows = await asyncio.gather(
            *[one_request(client, p, max_tokens, temperature, d) for p, d in zip(prompts, delays)]
        )
    makespan = max(r["end"] for r in rows) - min(r["start"] for r in rows)
    ttft, tpot = np.array([r["ttft"] for r in rows]), np.array([r["tpot"] for r in rows])
    return {
        "rate": rate,
        "requests": len(rows),
        "tokens": sum(r["tokens"] for r in rows),
        "tok_per_s": sum(r["tokens"] for r in rows) / makespan,
        "ttft_p50": float(np.percentile(ttft, 50)),
        "ttft_p99": float(np.percentile(ttft, 99)),
        "tpot_p50": float(np.percentile(tpot, 50)),
        "tpot_p99": float(np.percentile(tpot, 99)),
    }


def report(results: dict, args) -> str:
    lines = [
        "# Serving benchmark: vllm serve + openai clients (CPU build)",
        "",
        f"Command: `python benchmarks/serving.py {' '.join(sys.argv[1:])}`. Machine: {host_cpu().label}, "
        f"{platform.platform()}. Qwen2.5-Coder 1.5B target / 0.5B draft, {serving_dtype()}, "
        f"MT-Bench prompts (chat), {args.requests} requests per rate, Poisson arrivals, {args.max_tokens} output "
        f"tokens (ignore_eos), temperature {args.temperature}. One server at a time, all rows from one run.",
        "",
        "| config | rate (req/s) | tok/s | vs no spec | TTFT p50 / p99 (s) | TPOT p50 / p99 (s) "
        "| vs no spec (TPOT p50) |",
        "|---|---|---|---|---|---|---|",
    ]
    base = {r["rate"]: r for r in results.get("nospec", [])}
    for name, rows in results.items():
        for r in rows:
            b = base.get(r["rate"])
            ratio = r["tok_per_s"] / b["tok_per_s"] if b else float("nan")
            tpot_ratio = r["tpot_p50"] / b["tpot_p50"] if b else float("nan")
            lines.append(
                f"| {name} | {r['rate']:g} | {r['tok_per_s']:.2f} | {ratio:.2f}x | "
                f"{r['ttft_p50']:.2f} / {r['ttft_p99']:.2f} | {r['tpot_p50']:.3f} / {r['tpot_p99']:.3f} | "
                f"{tpot_ratio:.2f}x |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--configs", nargs="+", default=["nospec", "chain", "univer", "rrsw", "traversal"], choices=sorted(CONFIGS)
    )
    ap.add_argument("--rates", nargs="+", type=float, default=[1.0, 4.0, 16.0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    args = ap.parse_args()

    from data import DEFAULT_DRAFT, DEFAULT_TARGET, model_dir, prompts

    target, draft = str(model_dir(DEFAULT_TARGET)), str(model_dir(DEFAULT_DRAFT))
    texts = [p["turns"][0] for p in prompts("mtbench", limit=args.requests)]
    results: dict[str, list] = {}
    for name in args.configs:
        print(f"[serving] {name} ...", flush=True)
        log = Path(tempfile.gettempdir()) / f"vllm_univer_serving_{name}.log"
        args_ = server_args(target, draft, CONFIGS[name])
        with vllm_serve(args_, {**os.environ, **SERVER_ENV}, timeout=600, log_path=log, grace=60) as (_, url):
            results[name] = [
                asyncio.run(drive(url, texts, rate, args.max_tokens, args.temperature)) for rate in args.rates
            ]
        print(json.dumps(results[name]), flush=True)
        (RESULTS / "serving.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    text = report(results, args)
    (RESULTS / "serving.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
