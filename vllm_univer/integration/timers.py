"""Wall-clock totals of the tree-speculation work, for benchmarks (off by default).

``VLLM_UNIVER_TIMERS=1`` turns them on; on CUDA each measurement synchronises
the device, so leave them off in production.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from contextlib import contextmanager

import torch


class StepTimers:
    def __init__(self, device: torch.device, enabled: bool | None = None):
        self.enabled = os.environ.get("VLLM_UNIVER_TIMERS") == "1" if enabled is None else enabled
        self.totals: dict[str, float] = defaultdict(float)
        self._sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    @contextmanager
    def measure(self, name: str):
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
