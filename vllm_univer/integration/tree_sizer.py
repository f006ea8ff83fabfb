"""``"tree": "auto"``: the depth cut of the configured tree for each step
(``vllm_univer.sizing``), fed with this runner's measurements.

* Start-up (after vLLM's warm-up, ``calibrate``): the target's and the draft's
  forward times at a few token counts, through vLLM's own dummy runs.
* Every step: the wall-clock period between two drafting calls, against the
  forwards that period ran (the target's scheduled tokens, the draft forwards
  of the previous drafting, which the drafter still holds), corrects the cost model of the depth it ran at;
  the verifier's accepted depths update the acceptance model.

Decisions are made on the host from host data (no device sync of their own).
Under tensor parallelism every rank measures its own steps, so rank 0 decides
and the others take its decision (one small broadcast on the CPU group per
step): all ranks must draft the same trees.
"""

from __future__ import annotations

import os
import time
from collections import Counter

import numpy as np
import torch
from vllm.logger import init_logger

from ..sizing import AcceptanceModel, DepthChooser, ForwardCost, StepCostModel, StepWork, temperature_band
from ..tree import TreeSpec

logger = init_logger(__name__)

# Test hook: a fixed cycle of depth cuts, "2,0,3" -> batch row i at decision k is
# cut to depths[(k + i) % 3] (cuts that change between steps and within a batch),
# in place of the choice; the measurements still run.
SCHEDULE_ENV = "VLLM_UNIVER_AUTO_DEPTHS"
# Forwards are timed at start-up up to this many query tokens (compute-bound beyond: linear).
CALIBRATION_MAX_TOKENS = 128


def _bands(temperature: np.ndarray) -> np.ndarray:
    """Temperature bands of vLLM's host temperatures (below SAMPLING_EPS: greedy)."""
    return temperature_band(np.where(temperature < 1e-5, 0.0, temperature))


def _tp_group(runner):
    """vLLM's tensor-parallel group when there is more than one rank, else None."""
    if runner.parallel_config.tensor_parallel_size == 1:
        return None
    from vllm.distributed.parallel_state import get_tp_group

    return get_tp_group()


class TreeSizer:
    def __init__(self, runner, tree: TreeSpec, drafter):
        self.runner = runner
        self.tree = tree
        self.drafter = drafter  # its ``forward_tokens``: the draft forwards of the last drafting
        self.acceptance = AcceptanceModel(tree.max_depth)
        self.chooser: DepthChooser | None = None
        self._last: tuple[float, int] | None = None  # (time, deepest cut) of the last choice
        schedule = os.environ.get(SCHEDULE_ENV)
        self._schedule = [int(d) for d in schedule.split(",")] if schedule else None
        if self._schedule and not all(0 <= d <= tree.max_depth for d in self._schedule):
            raise ValueError(f"{SCHEDULE_ENV}={schedule!r}: depths must lie in 0..{tree.max_depth}")
        self._decisions = 0
        self._tp_group = _tp_group(runner)
        self.requests_at_depth = Counter()  # depth cut -> request-steps drafted at it

    # -------------------------------------------------------------- start-up
    def calibrate(self) -> None:
        """Time the target's and the draft's forwards at token counts 1, 2, 4, ...
        up to what one step can schedule, at most ``CALIBRATION_MAX_TOKENS``
        (beyond, the cost model extends the last slope), through vLLM's dummy runs."""
        runner = self.runner
        cap = min(
            runner.scheduler_config.max_num_batched_tokens,
            runner.scheduler_config.max_num_seqs * (self.tree.num_nodes + 1),
            CALIBRATION_MAX_TOKENS,
        )
        sizes = sorted({1 << k for k in range(int(np.log2(max(cap, 1))) + 1)} | {cap})
        proposer = runner.drafter
        sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)

        def timed(fn) -> float:
            sync()
            start = time.perf_counter()
            fn()
            sync()
            return time.perf_counter() - start

        def target_run(n):
            # The runner's dummy run also makes the drafter's: shadow it on this instance.
            proposer.dummy_run = lambda *args, **kwargs: None
            try:
                runner._dummy_run(n)
            finally:
                del proposer.dummy_run

        start_all = time.perf_counter()
        devices = [runner.device] if runner.device.type == "cuda" else []
        proposer.univer_forwards = 1  # one draft forward per dummy run (patch_proposer_dummy_run)
        try:
            with torch.random.fork_rng(devices=devices):  # vLLM seeded the generators after its warm-up
                target_run(sizes[0])
                proposer.dummy_run(sizes[0])  # warm: first calls allocate
                target = [timed(lambda n=n: target_run(n)) for n in sizes]
                draft = [timed(lambda n=n: proposer.dummy_run(n)) for n in sizes]
        finally:
            del proposer.univer_forwards
        self.calibration = {
            "tokens": sizes,
            "target_ms": [1e3 * t for t in target],
            "draft_ms": [1e3 * t for t in draft],
        }
        self.chooser = DepthChooser(
            StepCostModel(ForwardCost(sizes, target), ForwardCost(sizes, draft), self.tree.nodes_per_depth),
            self.acceptance,
        )
        logger.info("tree auto: calibrated in %.1f s: %s", time.perf_counter() - start_all, self.calibration)

    # ------------------------------------------------------------ each step
    def choose(self, batch: int):
        """Depth cut for the trees drafted now, for the ``batch`` requests in the
        runner's batch (the next step's batch, as far as anyone knows): one int
        for all, or (test schedule) one per batch row."""
        now = time.perf_counter()
        if self.chooser is None:  # not calibrated (warm-up skipped): speculate in full
            return self.tree.max_depth
        self._observe_period(now, batch)
        temperature = self.runner.input_batch.temperature_cpu[:batch]
        depth = self.chooser.choose(_bands(temperature))
        self._decisions += 1
        if self._schedule is not None:
            cycle = np.asarray(self._schedule)
            depth = cycle[(self._decisions + np.arange(batch)) % len(cycle)]
        if self._tp_group is not None:
            depth = self._tp_group.broadcast_object(depth, src=0)
        depths = np.broadcast_to(depth, (batch,))
        self.requests_at_depth.update(depths.tolist())
        self._last = (now, int(depths.max(initial=0)))
        return depth

    def observe_acceptance(self, temperature: np.ndarray, cut_depths: np.ndarray, accepted: np.ndarray) -> None:
        """Verified trees: their requests' temperatures, cut depths and accepted depths."""
        self.acceptance.observe(_bands(temperature), cut_depths, accepted)

    def _observe_period(self, now: float, batch: int) -> None:
        if self._last is None:
            return
        started, depth = self._last
        target_tokens = int(self.runner.query_start_loc.np[batch])
        work = StepWork(target_tokens, list(self.drafter.forward_tokens))
        self.chooser.cost.observe(depth, work, now - started)

    def summary(self) -> dict:
        """Steps per chosen depth, the acceptance hazards and cost corrections (benchmarks, tests)."""
        if self.chooser is None:
            return {}
        return {
            "requests_at_depth": {int(d): n for d, n in sorted(self.requests_at_depth.items())},
            "hazards": self.acceptance.hazards().round(3).tolist(),
            "cost_correction": self.chooser.cost.correction.round(3).tolist(),
            "calibration": self.calibration,
        }
