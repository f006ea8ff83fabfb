"""The main job as a new user meets it, against plain ``vllm serve``, on this machine.

For each server, one after another: the time from launch until it answers
(the main job: until it prints its Ready block), then the README's example
request (chat, "Write a Python function that reverses a list.", 128 tokens,
T = 1) three times and once at T = 0, through the ``openai`` client; tokens/s
= completion tokens / wall time of the request.

    python -m benchmarks.main_job                      # plain vllm serve, main job TREE=auto, TREE=2x3
    python -m benchmarks.main_job --trees auto          # fewer rows

Results: ``results/main_job.md`` (and ``.json``; ``--out NAME``: ``results/NAME.md``,
to keep another machine's table beside it). Models must be cached
(``scripts/main.sh`` fetches them on its first run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from vllm_univer.tools.host_cpu import host_cpu
from vllm_univer.tools.local_server import free_port, stop, vllm_serve
from vllm_univer.tools.serving_defaults import LOCAL_SERVER_ENV, hardware_defaults

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

PROMPT = "Write a Python function that reverses a list."


def example_requests(url: str, model: str) -> list[dict]:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    runs = []
    for temperature in (1.0, 1.0, 1.0, 0.0):
        start = time.perf_counter()
        out = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=128, temperature=temperature
        )
        wall = time.perf_counter() - start
        tokens = out.usage.completion_tokens
        runs.append({"temperature": temperature, "tokens": tokens, "wall_s": wall, "tok_per_s": tokens / wall})
        print(f"  T={temperature}: {tokens} tokens in {wall:.1f} s", flush=True)
    return runs


def main_job(tree: str, log: Path, timeout: float) -> dict:
    port = free_port()
    env = {**os.environ, **LOCAL_SERVER_ENV, "PORT": str(port), "TREE": tree}
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "scripts" / "serve_default.py")],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            while "Ready:" not in log.read_text():
                if proc.poll() is not None or time.perf_counter() - start > timeout:
                    raise RuntimeError(f"main job (TREE={tree}) did not come up; log: {log}")
                time.sleep(1)
            ready = time.perf_counter() - start
            print(f"main job TREE={tree}: Ready after {ready:.0f} s", flush=True)
            hardware = next(x for x in log.read_text().splitlines() if x.startswith(("CPU:", "GPU:")))
            return {
                "name": f"main job, tree {tree}",
                "ready_s": ready,
                "hardware": hardware,
                "runs": example_requests(f"http://127.0.0.1:{port}", "qwen2.5-coder-1.5b"),
            }
        finally:
            stop(proc, grace=60)


def plain_server(log: Path, timeout: float, dtype: str, extra: list[str], extra_env: dict[str, str]) -> dict:
    from vllm_univer.tools.real_models import DEFAULT_TARGET, model_dir

    args = [str(model_dir(DEFAULT_TARGET)), "--served-model-name", "target", "--dtype", dtype]
    args += ["--max-model-len", "4096", *extra]
    start = time.perf_counter()
    with vllm_serve(args, {**extra_env, **os.environ, **LOCAL_SERVER_ENV}, timeout, log, grace=60) as (_, url):
        ready = time.perf_counter() - start
        print(f"plain vllm serve: healthy after {ready:.0f} s", flush=True)
        return {"name": "plain vllm serve", "ready_s": ready, "runs": example_requests(url, "target")}


def report(rows: list[dict], command: str) -> str:
    plain = next((r for r in rows if r["name"] == "plain vllm serve"), None)

    def mean_rate(row, hot: bool):
        rates = [x["tok_per_s"] for x in row["runs"] if (x["temperature"] > 0) == hot]
        return sum(rates) / len(rates)

    hardware = next((r["hardware"] for r in rows if "hardware" in r), f"CPU: {host_cpu().label}")
    lines = [
        "# The main job against plain vllm serve",
        "",
        f"Command: `{command}`. Machine: {hardware}. Models cached. Ready: from launch to the main job's Ready "
        "block (plain: to /health). The README's example request (128 tokens) three times at T = 1 and once at "
        "T = 0, one after another, through the openai client; tokens/s = completion tokens / request wall time.",
        "",
        "| server | ready (s) | tok/s T=1 (mean of 3) | vs plain | tok/s T=0 | vs plain |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        hot, cold = mean_rate(r, True), mean_rate(r, False)
        vs_hot = f"{hot / mean_rate(plain, True):.2f}x" if plain else "-"
        vs_cold = f"{cold / mean_rate(plain, False):.2f}x" if plain else "-"
        lines.append(f"| {r['name']} | {r['ready_s']:.0f} | {hot:.2f} | {vs_hot} | {cold:.2f} | {vs_cold} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", nargs="+", default=["auto", "2x3"])
    ap.add_argument("--no-plain", action="store_true")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default="main_job", help="results/OUT.md and .json")
    args = ap.parse_args()
    dtype, _, extra, extra_env = hardware_defaults([])
    rows = []
    logs = Path("/tmp")
    if not args.no_plain:
        rows.append(plain_server(logs / "main_job_plain.log", args.timeout, dtype, extra, extra_env))
    for tree in args.trees:
        rows.append(main_job(tree, logs / f"main_job_{tree}.log", args.timeout))
    command = "python -m benchmarks.main_job " + " ".join(sys.argv[1:])
    text = report(rows, command.strip())
    (HERE / "results" / f"{args.out}.json").write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    (HERE / "results" / f"{args.out}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
