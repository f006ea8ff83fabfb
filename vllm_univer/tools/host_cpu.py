"""What the CPU this process runs on can do fast, for choosing serving defaults
and for labelling benchmark numbers (pure Python and PyTorch, no vLLM import)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# vLLM's CPU build keeps one core per worker for its scheduler process
# (VLLM_CPU_NUM_OF_RESERVED_CPU). On a machine with this few cores that core is a
# quarter or more of its compute.
FEW_CORES = 4


@dataclass(frozen=True)
class HostCpu:
    model: str
    capability: str  # torch.backends.cpu.get_cpu_capability(): "AVX2", "AVX512", ...
    native_bf16: bool  # bfloat16 matmuls in hardware (AVX512_BF16 or AMX), not emulated
    cores: int  # CPUs this process may run on

    @property
    def label(self) -> str:
        bf16 = "native bf16" if self.native_bf16 else "no native bf16"
        return f"{self.model}, {self.capability}, {bf16}, {self.cores} cores"

    def serving_dtype(self) -> tuple[str, str]:
        """(dtype, why) for serving on this CPU: without native bfloat16, PyTorch
        emulates bf16 matmuls (measured 10 against 26 GFLOP/s for float32 on a
        2-core AVX2 EPYC, one thread), and tree rows make the forward compute-bound."""
        if self.native_bf16:
            return "bfloat16", "the CPU has native bfloat16 (AVX512_BF16 / AMX)"
        return "float32", "the CPU has no native bfloat16, where float32 matmuls run ~2.5x faster than emulated bf16"

    def reserved_cores(self) -> tuple[int | None, str]:
        """(VLLM_CPU_NUM_OF_RESERVED_CPU for serving, why); None keeps vLLM's
        default (one core per worker left to the scheduler process). With few
        cores the worker's forwards are worth more than an idle scheduler core:
        on a 2-core EPYC, plain ``vllm serve`` went from 4.6 to 7.4 tok/s at T = 1
        with both cores (benchmarks/results/main_job_reserved_core.md)."""
        if self.cores <= FEW_CORES:
            return (
                0,
                f"every core to the model: with {self.cores} cores, a scheduler core costs more than it gives",
            )
        return None, "vLLM's default: one core kept for the scheduler"


def host_cpu() -> HostCpu:
    import torch

    flags, model = set(), "unknown CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "flags" and not flags:
                flags = set(value.split())
            elif key.strip() == "model name" and model == "unknown CPU":
                model = value.strip()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return HostCpu(
        model=model,
        capability=torch.backends.cpu.get_cpu_capability(),
        native_bf16=bool(flags & {"avx512_bf16", "amx_bf16"}),
        cores=cores,
    )
