"""Wall-clock totals of the tree-speculation work, for benchmarks (off by default).

``VLLM_UNIVER_TIMERS=1`` turns them on; on CUDA each measurement synchronises
the device, so leave them off in production.

``VLLM_UNIVER_OP_COUNTS=1`` counts, per section, the ATen ops (kernel launches
on CUDA) and host syncs the package issues (``op_counter``; the innermost open
section gets each op, so "draft" excludes its "draft_forward"). For tests and
benchmarks only: every op then passes through Python.
"""

from __future__ import annotations

import os
import time
from collections import Counter, defaultdict
from contextlib import contextmanager

import torch

from ..tools.op_counter import OpCounter


class StepTimers:
    def __init__(self, device: torch.device, enabled: bool | None = None):
        self.enabled = os.environ.get("VLLM_UNIVER_TIMERS") == "1" if enabled is None else enabled
        self.totals: dict[str, float] = defaultdict(float)
        self.calls: Counter = Counter()
        self.ops = OpCounter() if os.environ.get("VLLM_UNIVER_OP_COUNTS") == "1" else None
        self._open = 0
        self._sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    @contextmanager
    def measure(self, name: str):
        self.calls[name] += 1
        if self.ops is not None:
            with self._counting(name):
                yield
            return
        if not self.enabled:
            yield
            return
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.totals[name] += time.perf_counter() - start

    @contextmanager
    def counted(self, name: str):
        """A section counted by the op counter only, never timed: work inside vLLM's
        preparation of the target forward, where a timer's device syncs would stall
        what the benchmarks time."""
        self.calls[name] += 1
        if self.ops is None:
            yield
            return
        with self._counting(name):
            yield

    @contextmanager
    def _counting(self, name: str):
        if self._open == 0:
            self.ops.__enter__()
        self._open += 1
        self.ops.push(name)
        try:
            yield
        finally:
            self.ops.pop()
            self._open -= 1
            if self._open == 0:
                self.ops.__exit__(None, None, None)

    def op_counts(self) -> dict[str, dict[str, int]]:
        """Per section: {"kernels", "syncs", "calls"} so far (``VLLM_UNIVER_OP_COUNTS=1``)."""
        if self.ops is None:
            return {}
        return {name: {**OpCounter.summary(ops), "calls": self.calls[name]} for name, ops in self.ops.sections.items()}
