"""``vllm_univer.tools.json_job``: one job per process, JSON in and out."""

import os

import pytest

from vllm_univer.tools.json_job import JsonWorker, run_json_job

pytestmark = pytest.mark.quick

ECHO = "import json, sys\nfrom vllm_univer.tools.json_job import print_result\nprint_result(json.load(sys.stdin))"


def test_result_comes_back():
    assert run_json_job(["-c", ECHO], {"a": [1, 2]}, dict(os.environ), timeout=60) == ({"a": [1, 2]}, "")


def test_a_job_past_its_time_fails_alone():
    # A benchmark's engine that hangs must not take the benchmark down with it.
    sleeper = "import sys, time\nprint('started', file=sys.stderr, flush=True)\ntime.sleep(30)"
    result, stderr = run_json_job(["-c", sleeper], {}, dict(os.environ), timeout=2)
    assert result is None and "timed out after 2 s" in stderr


def test_a_job_that_prints_no_result():
    result, stderr = run_json_job(["-c", "import sys; sys.exit('boom')"], {}, dict(os.environ), timeout=60)
    assert result is None and "boom" in stderr


# A worker that keeps its job: answers each request with the job's value plus the request.
ADDER = """import json, sys
from vllm_univer.tools.json_job import print_result
job = json.loads(sys.stdin.readline())
print("a log line on stdout", flush=True)
print_result({"ready": job["base"]})
for line in sys.stdin:
    print_result(job["base"] + json.loads(line))
"""


def test_a_worker_answers_many_requests_in_turn(tmp_path):
    worker = JsonWorker(["-c", ADDER], {"base": 10}, dict(os.environ), str(tmp_path / "log"))
    try:
        assert worker.first == {"ready": 10}
        assert [worker.ask(n) for n in (1, 2, 3)] == [11, 12, 13]
    finally:
        worker.close()
    assert worker.proc.returncode == 0


def test_a_worker_that_dies_names_its_log(tmp_path):
    crash = "import sys\nsys.stdin.readline()\nsys.exit('boom')"
    with pytest.raises(RuntimeError, match="before answering") as caught:
        JsonWorker(["-c", crash], {}, dict(os.environ), str(tmp_path / "log"))
    assert str(tmp_path / "log") in str(caught.value)
    assert "boom" in (tmp_path / "log").read_text()


def test_asking_a_worker_that_has_exited_says_so(tmp_path):
    one_answer = "import sys\nfrom vllm_univer.tools.json_job import print_result\nsys.stdin.readline()\n"
    one_answer += "print_result(1)"
    worker = JsonWorker(["-c", one_answer], {}, dict(os.environ), str(tmp_path / "log"))
    worker.proc.wait(timeout=60)
    with pytest.raises(RuntimeError, match="exited with 0 before answering"):
        worker.ask(2)
    worker.close()
