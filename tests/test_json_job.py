"""``vllm_univer.tools.json_job``: one job per process, JSON in and out."""

import os

from vllm_univer.tools.json_job import run_json_job

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
