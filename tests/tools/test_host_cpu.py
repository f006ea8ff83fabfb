"""The main job's settings per CPU (vllm_univer.tools.host_cpu, tools.serving_defaults):
what it picks from the CPU it finds, and that the user's own settings win."""

from __future__ import annotations

import pytest

from vllm_univer.tools import host_cpu as host_cpu_module
from vllm_univer.tools.host_cpu import HostCpu
from vllm_univer.tools.serving_defaults import CPU_MAX_BATCHED_TOKENS, hardware_defaults

AVX2_2 = HostCpu(model="EPYC", capability="AVX2", native_bf16=False, cores=2)
AMX_64 = HostCpu(model="Xeon", capability="AVX512", native_bf16=True, cores=64)


def test_dtype_and_reserved_cores_follow_the_cpu():
    assert AVX2_2.serving_dtype()[0] == "float32"
    assert AMX_64.serving_dtype()[0] == "bfloat16"
    assert AVX2_2.reserved_cores()[0] == 0
    assert AMX_64.reserved_cores()[0] is None  # vLLM's own default


@pytest.fixture
def on_cpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("DTYPE", "VLLM_CPU_NUM_OF_RESERVED_CPU"):
        monkeypatch.delenv(name, raising=False)

    def use(cpu: HostCpu):
        monkeypatch.setattr(host_cpu_module, "host_cpu", lambda: cpu)

    return use


def test_main_job_defaults_on_a_small_avx2_cpu(on_cpu):
    on_cpu(AVX2_2)
    dtype, line, args, env = hardware_defaults([])
    assert dtype == "float32" and env == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    assert args == ["--max-num-batched-tokens", str(CPU_MAX_BATCHED_TOKENS)]
    assert "dtype float32" in line and "0 reserved cores" in line


def test_main_job_defaults_leave_a_large_cpu_and_the_user_alone(on_cpu, monkeypatch):
    on_cpu(AMX_64)
    dtype, line, args, env = hardware_defaults(["--max-num-batched-tokens", "4096"])
    assert dtype == "bfloat16" and env == {} and args == [] and "vLLM default reserved cores" in line

    on_cpu(AVX2_2)
    monkeypatch.setenv("DTYPE", "bfloat16")
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    dtype, line, args, env = hardware_defaults([])
    assert dtype == "bfloat16" and env == {}  # the user's environment is passed on as it is
    assert "set by DTYPE" in line and "set by VLLM_CPU_NUM_OF_RESERVED_CPU" in line
