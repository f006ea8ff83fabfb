"""The main job's server launcher (scripts/serve_default.py) on tiny models: it
prints the URL and a working openai example, serves, and Ctrl-C stops it cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from server_utils import server_env  # noqa: E402

from vllm_univer.tools.local_server import free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def test_main_job_serves_and_stops_on_ctrl_c(tiny_pair, tmp_path):
    target, draft = tiny_pair
    port = free_port()
    env = server_env(
        TARGET_MODEL=str(target), DRAFT_MODEL=str(draft), PORT=str(port), DTYPE="float32", SERVED_MODEL_NAME="tiny"
    )
    log = tmp_path / "main.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "scripts" / "serve_default.py"), "--enforce-eager", "--max-model-len", "512"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            started = time.time()
            deadline = started + 240
            while "Ready:" not in log.read_text():
                assert proc.poll() is None, log.read_text()[-3000:]
                assert time.time() < deadline, "no Ready line"
                time.sleep(1)
            text = log.read_text()
            print(f"\nmain job on the tiny models: Ready after {time.time() - started:.0f} s")
            assert f"http://127.0.0.1:{port}/v1" in text and "from openai import OpenAI" in text
            assert "UniVer tree auto" in text  # the default: the tree sizes itself
            assert "CPU: " in text and "dtype float32 (set by DTYPE)" in text  # what it chose, and why
            assert "reserved cores (" in text  # the thread setting, and why
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
            reply = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "the tree"}], max_tokens=16, temperature=1.0
            )
            assert reply.usage.completion_tokens > 0
        finally:
            os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends
            rc = proc.wait(timeout=60)
    assert rc == 0, log.read_text()[-3000:]
