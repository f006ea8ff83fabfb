"""Start a real ``vllm serve`` on 127.0.0.1 for tests and stop it cleanly."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from engine_job import ENV


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def vllm_server(
    model: str,
    speculative_config: dict | None = None,
    extra_args: tuple[str, ...] = (),
    timeout: float = 240,
    log_path: Path | None = None,
):
    """Yield the base URL (``http://127.0.0.1:PORT``) of a running server."""
    port = free_port()
    vllm_bin = Path(sys.executable).parent / "vllm"
    cmd = [
        str(vllm_bin),
        "serve",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "1024",
        "--block-size",
        "32",
        "--seed",
        "0",
        *extra_args,
    ]
    if speculative_config is not None:
        cmd += ["--speculative-config", json.dumps(speculative_config)]
    env = {**os.environ, **ENV}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the server runs its engine core in its own process
    log = open(log_path or os.devnull, "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode}; log: {log_path}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                raise TimeoutError(f"vllm serve not healthy after {timeout} s; log: {log_path}")
            time.sleep(1)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def metric_value(metrics_text: str, name: str) -> float:
    """Sum of the samples of one Prometheus metric (all label sets)."""
    total, found = 0.0, False
    for line in metrics_text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    if not found:
        raise KeyError(name)
    return total
