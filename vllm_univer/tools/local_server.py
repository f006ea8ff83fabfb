"""A ``vllm serve`` process on 127.0.0.1: start, wait until ``/health`` answers, stop."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_executable() -> str:
    """The ``vllm`` command of this interpreter's environment."""
    return str(Path(sys.executable).parent / "vllm")


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float, log: Path | str | None = None) -> None:
    """Return once ``url``/health answers 200; raise if the server exits or ``timeout`` passes."""
    deadline = time.time() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode}; log: {log}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.time() > deadline:
            raise TimeoutError(f"vllm serve not healthy after {timeout} s; log: {log}")
        time.sleep(1)


def stop(proc: subprocess.Popen, grace: float = 30) -> None:
    """SIGINT to the server's process group (vLLM shuts its engine down), SIGKILL after ``grace`` seconds."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def vllm_serve(args: list[str], env: dict, timeout: float, log_path: Path | str | None = None, grace: float = 30):
    """Run ``vllm serve <args> --host 127.0.0.1 --port P`` (its own process group);
    yield (process, base URL) once healthy; stop it on exit."""
    port = free_port()
    cmd = [vllm_executable(), "serve", *args, "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path or os.devnull, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(proc, url, timeout, log_path)
            yield proc, url
        finally:
            stop(proc, grace)
