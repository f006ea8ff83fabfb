"""Run a job in a fresh Python process: JSON in on stdin, JSON out on the last
stdout line that starts with ``RESULT `` (vLLM keeps global state; one engine
per process keeps every engine clean, and a crash costs only its own job)."""

from __future__ import annotations

import json
import subprocess
import sys

MARK = "RESULT "


def run_json_job(args: list[str], job, env: dict, timeout: float | None = None) -> tuple[object | None, str]:
    """``python <args>`` with ``job`` on stdin -> (its result, or None if it printed none; its stderr)."""
    proc = subprocess.run(
        [sys.executable, *args], input=json.dumps(job), text=True, capture_output=True, env=env, timeout=timeout
    )
    line = next((x for x in reversed(proc.stdout.splitlines()) if x.startswith(MARK)), None)
    return (None if line is None else json.loads(line[len(MARK) :])), proc.stderr


def print_result(result) -> None:
    """The job side: answer with ``result``."""
    print(MARK + json.dumps(result), flush=True)
