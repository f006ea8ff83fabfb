"""Run a job in a fresh Python process: JSON in on stdin, JSON out on the last
stdout line that starts with ``RESULT `` (vLLM keeps global state; one engine
per process keeps every engine clean, and a crash costs only its own job)."""

from __future__ import annotations

import json
import subprocess
import sys

MARK = "RESULT "
TIMED_OUT = "[json_job] timed out"  # in the stderr of a job killed at its timeout


def run_json_job(args: list[str], job, env: dict, timeout: float | None = None) -> tuple[object | None, str]:
    """``python <args>`` with ``job`` on stdin -> (its result, or None if it printed none
    or ran past ``timeout`` seconds; its stderr)."""
    try:
        proc = subprocess.run(
            [sys.executable, *args], input=json.dumps(job), text=True, capture_output=True, env=env, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:  # killed; a job past its time is a failed job, not a crash
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        return None, f"{err}\n{TIMED_OUT} after {timeout:.0f} s"
    line = next((x for x in reversed(proc.stdout.splitlines()) if x.startswith(MARK)), None)
    return (None if line is None else json.loads(line[len(MARK) :])), proc.stderr


def print_result(result) -> None:
    """The job side: answer with ``result``."""
    print(MARK + json.dumps(result), flush=True)


class JsonWorker:
    """A job's process kept alive to answer many requests: the job goes on its first
    stdin line, then each request on one line, each answered by a ``RESULT`` line
    (``print_result``). Its stderr goes to ``log_path`` (vLLM logs a lot; a pipe
    nobody reads would block it)."""

    def __init__(self, args: list[str], job, env: dict, log_path: str):
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            [sys.executable, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env
        )
        try:
            self.first = self.ask(job)
        except RuntimeError:
            self.close()
            raise

    def ask(self, request):
        """Send ``request``, wait for its answer (lines before it are the job's own output)."""
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:  # it has exited: said below
            pass
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])
        raise RuntimeError(f"worker exited with {self.proc.wait()} before answering; its stderr: {self.log_path}")

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()
