"""Start a real ``vllm serve`` on 127.0.0.1 for tests and stop it cleanly."""

from __future__ import annotations

import contextlib
import json
import os
import urllib.request
from pathlib import Path

from engine_job import ENV

from vllm_univer.tools.local_server import vllm_serve

# What every test server runs with, besides the model (the engine tests' BASE_KWARGS).
SERVER_ARGS = ("--dtype", "float32", "--enforce-eager", "--max-model-len", "1024", "--block-size", "32", "--seed", "0")


def server_env(**extra: str) -> dict:
    """The test environment for ``vllm serve``, with ``extra`` variables."""
    env = {**os.environ, **ENV, **extra}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the server runs its engine core in its own process
    return env


@contextlib.contextmanager
def vllm_server(
    model: str,
    speculative_config: dict | None = None,
    extra_args: tuple[str, ...] = (),
    timeout: float = 240,
    log_path: Path | None = None,
    env: dict | None = None,
):
    """Yield the base URL (``http://127.0.0.1:PORT``) of a running server
    (environment ``env``, default ``server_env()``)."""
    args = [model, *SERVER_ARGS, *extra_args]
    if speculative_config is not None:
        args += ["--speculative-config", json.dumps(speculative_config)]
    with vllm_serve(args, env or server_env(), timeout, log_path) as (_, url):
        yield url


def streamed_chat(client, model: str) -> list[str]:
    """The pieces of a streamed chat completion at T = 1 (30 tokens, EOS ignored)."""
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "a cat and a dog"}],
        max_tokens=30,
        temperature=1.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    return [c.choices[0].delta.content or "" for c in stream if c.choices]


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
