"""``"tree": "auto"``: the cut of the configured tree for each step, a width
cut (its shape) and a depth (``vllm_univer.sizing``), fed with this runner's
measurements.

* Start-up (after vLLM's warm-up, ``calibrate``): the target's and the draft's
  forward times at a few token counts, through vLLM's own dummy runs.
* Every step: the wall-clock period between two choices, against the
  forwards that period ran (the target's scheduled tokens, the draft forwards
  of the previous drafting, which the drafter still holds), corrects the cost
  model of the cut it ran (of every shape where it did not speculate); the
  verifier's accepted depths update the acceptance model of the shape drafted,
  once the drafter has launched its forwards (``defer``: on a GPU the host is
  then free while the device drafts).
* The choice for a step's drafting is made once its target forward is launched
  (``choose_ahead``): on a GPU the host would otherwise wait for that forward,
  and the choice needs nothing from its verification (acceptance one step
  older changes nothing that matters). Where no forward hook ran, ``choose``
  makes it at drafting time.

A step with a structured-output request drafts the full tree only: vLLM's
scheduler builds its grammar bitmask rows from the draft count alone
(``tree_grammar``), which names a depth cut of one shape, not the shape.

Decisions are made on the host from host data (no device sync of their own).
Under tensor parallelism every rank measures its own steps, so rank 0 decides
and the others take its decision (one small broadcast on the CPU group per
step): all ranks must draft the same trees.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter

import numpy as np
import torch
from vllm.logger import init_logger

from ..core.tree import TreeSpec
from ..core.tree_batch import LevelLayout
from ..sizing import (
    NUM_BANDS,
    AcceptanceModel,
    Cut,
    ForwardCost,
    ShapeModels,
    StepCostModel,
    StepWork,
    TreeChooser,
    catch_up_budget,
    children_per_node,
    prior_hazards,
    temperature_band,
)
from .full_graph_lengths import target_dummy_runs
from .sampling.request_options import has_structured_output

logger = init_logger(__name__)

# Test hook: a fixed cycle of depth cuts, "2,0,3" -> batch row i at decision k is
# cut to depths[(k + i) % 3] (cuts that change between steps and within a batch;
# with ONE_DEPTH_ENV, depths[k % 3] for every row), in place of the choice; the
# measurements still run.
SCHEDULE_ENV = "VLLM_UNIVER_AUTO_DEPTHS"
# Test hook: a fixed cycle of width cuts, "1,2" -> decision k drafts max_tree.width_cut(widths[k % 2])
# (0: the dynamic trees, where a budget makes them a candidate)
# (shapes that change between steps; depths beyond a shape's own are cut to it).
WIDTH_SCHEDULE_ENV = "VLLM_UNIVER_AUTO_WIDTHS"
# Benchmark and test hook: fixed acceptance hazards per shape width, JSON {"1": [h_1 .. h_D], "2": [...]}
# (or per temperature band: {"2": {"0": [...], "1": [...], "2": [...], "3": [...]}}):
# every band's acceptance model starts there and learns nothing (random-weight models
# accept nothing; ``benchmarks/gpu_engine.py`` gives the choice the real pair's acceptance).
FIXED_HAZARDS_ENV = "VLLM_UNIVER_AUTO_HAZARDS"
# Benchmark and test hook: "1" gives every request of a step the chosen (or scheduled) cut's depth
# (no depths of their own, per group of requests): ``benchmarks/engine_ab.py``'s row "univer auto
# one depth"; uniform batches of each cut under full CUDA graphs (``full_graph_lengths``).
ONE_DEPTH_ENV = "VLLM_UNIVER_AUTO_ONE_DEPTH"
# Diagnosis hook: a file path; one JSON line per decision (the batch, how far behind the draft
# is, the forwards the last period ran, the choice and its catch-up budget, the rates priced):
# ``benchmarks/sizer_trace.py`` reads it against the measured periods.
TRACE_ENV = "VLLM_UNIVER_AUTO_TRACE"
# Forwards are timed at start-up up to this many query tokens (compute-bound beyond: linear).
CALIBRATION_MAX_TOKENS = 128
CALIBRATION_PASSES = 3


def _bands(temperature: np.ndarray) -> np.ndarray:
    """Temperature bands of vLLM's host temperatures (below SAMPLING_EPS: greedy)."""
    return temperature_band(np.where(temperature < 1e-5, 0.0, temperature))


def _tp_group(runner):
    """vLLM's tensor-parallel group when there is more than one rank, else None."""
    if runner.parallel_config.tensor_parallel_size == 1:
        return None
    from vllm.distributed.parallel_state import get_tp_group

    return get_tp_group()


def _schedule(name: str, value: str | None, low: int, high: int) -> list[int] | None:
    if not value:
        return None
    cycle = [int(v) for v in value.split(",")]
    if not all(low <= v <= high for v in cycle):
        raise ValueError(f"{name}={value!r}: values must lie in {low}..{high}")
    return cycle


def shape_label(shape: TreeSpec | LevelLayout) -> int | str:
    """What names a candidate shape in hooks and summaries: its width (a width cut
    of max_tree), or "dyn" for the levels of context-aware trees."""
    return "dyn" if isinstance(shape, LevelLayout) else shape.max_children


def _fixed_hazards(value: str | None, shapes: list[TreeSpec]) -> list[np.ndarray] | None:
    """``FIXED_HAZARDS_ENV``: per shape, [D] hazards for every temperature band or
    [band, D] (a width given as {"0": [...], ..., "3": [...]}, one list per band);
    None: learn them."""
    if not value:
        return None

    def hazards_of(h) -> np.ndarray | None:
        if isinstance(h, dict):
            per_band = [h.get(str(band)) for band in range(NUM_BANDS)]
            if any(not isinstance(b, list) or len(b) != len(per_band[0]) for b in per_band):
                return None
            h = per_band
        return np.asarray(h, dtype=np.float64)

    by_width = {(w if w == "dyn" else int(w)): hazards_of(h) for w, h in json.loads(value).items()}
    out = []
    for shape in shapes:
        hazards = by_width.get(shape_label(shape))
        if (
            hazards is None
            or hazards.shape not in ((shape.max_depth,), (NUM_BANDS, shape.max_depth))
            or not ((hazards >= 0) & (hazards <= 1)).all()
        ):
            raise ValueError(
                f"{FIXED_HAZARDS_ENV}={value!r}: needs {shape.max_depth} hazards in [0, 1] "
                f"for width {shape_label(shape)} (or such a list for each temperature band 0..{NUM_BANDS - 1})"
            )
        out.append(hazards)
    return out


class TreeSizer:
    def __init__(self, runner, shapes: list[TreeSpec], drafter, one_cut_per_step: bool = False):
        """``shapes``: the width cuts of max_tree, narrowest first, max_tree last;
        one_cut_per_step: every request of a step gets the chosen cut's depth (no
        depths of their own): under full CUDA graphs, where a batch of one cut
        replays the target's graph of that cut's length (``full_graph_lengths``)
        and requests cut to different depths run piecewise."""
        self.runner = runner
        self.shapes = shapes
        self.tree = shapes[-1]
        self._dynamic = next((s for s in shapes if isinstance(s, LevelLayout)), None)  # context-aware trees
        self._shape_index = {shape: i for i, shape in enumerate(shapes)}
        self.drafter = drafter  # its ``forward_tokens``: the draft forwards of the last drafting
        self._fixed_hazards = _fixed_hazards(os.environ.get(FIXED_HAZARDS_ENV), shapes)
        learning = self._fixed_hazards is None
        self.acceptance = [
            AcceptanceModel(
                shape.max_depth, prior, children=children_per_node(shape.nodes_per_depth) if learning else None
            )
            for shape, prior in zip(shapes, self._fixed_hazards or [prior_hazards(s.nodes_per_depth) for s in shapes])
        ]
        # The chain among several shapes, hazards learnt: its acceptance is also read off the wider trees verified.
        chain = next((i for i, s in enumerate(shapes) if s.is_chain), None)
        self._chain = chain if len(shapes) > 1 and learning else None
        self.chooser: TreeChooser | None = None
        self._last: Cut | None = None  # the last choice's cut, at its deepest depth
        # Step periods (``step_started``, ``_step_verified``): the cut (deepest depth) and batch size
        # handed out for the last drafting and the one before; the last stamp; the period under
        # way's forwards, catch-up chunk tokens and batch size.
        self._drafted: tuple[Cut, int] | None = None
        self._drafted_before: tuple[Cut, int] | None = None
        self._stamp: float | None = None
        self._period: tuple[StepWork, int, int] | None = None
        # The host runs each forward to its end (CPU): the verification is done when drafting starts.
        self._synchronous = torch.device(runner.device).type != "cuda"
        self._ahead: tuple | None = None  # (the batch's requests, the choice) made during the target forward
        self.decisions_ahead = 0  # of the choices drafted, those made ahead
        self._deferred: list = []  # what verified trees teach, to be learnt (``defer``)
        self.set_schedule(os.environ.get(SCHEDULE_ENV), os.environ.get(WIDTH_SCHEDULE_ENV))
        self._decisions = 0
        self._own_depths = not one_cut_per_step and os.environ.get(ONE_DEPTH_ENV, "0") != "1"
        self._tp_group = _tp_group(runner)
        # (shape's width = max children, depth cut) -> request-steps drafted at it (depth 0: plain steps).
        self.requests_at_cut = Counter()
        self.catch_up: int | None = None  # the last choice's catch-up budget (None: the step's token budget)
        trace = os.environ.get(TRACE_ENV)
        deciding = self._tp_group is None or self._tp_group.rank_in_group == 0  # the rank that decides
        self._trace = open(trace, "a", buffering=1) if trace and deciding else None  # noqa: SIM115 (engine's lifetime)

    def set_schedule(self, depths: str | None, widths: str | None = None) -> None:
        """Test and benchmark hook (``SCHEDULE_ENV``, ``WIDTH_SCHEDULE_ENV``): fixed
        cycles of depth and width cuts in place of the choice ("2,0,3"; None: choose);
        the measurements still run. ``benchmarks/auto_ab.py`` switches them between runs."""
        self._schedule = _schedule(SCHEDULE_ENV, depths, 0, self.tree.max_depth)
        # 0: the dynamic trees (a candidate with a budget); wider than the tree: the tree
        self._width_schedule = _schedule(WIDTH_SCHEDULE_ENV, widths, 0 if self._dynamic else 1, 1 << 30)

    # -------------------------------------------------------------- start-up
    def calibrate(self) -> None:
        """Time the target's and the draft's forwards at token counts 1, 2, 4, ...
        up to what one step can schedule, at most ``CALIBRATION_MAX_TOKENS``
        (beyond, the cost model extends the last slope), through vLLM's dummy runs:
        the target's replaying a full CUDA graph where a step's would (``"cuda_graphs":
        "full"``); the draft's piecewise (its level graphs are the package's own, an
        overestimate there that the per-depth correction of the step time absorbs)."""
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

        # Under full CUDA graphs a step of one cut replays the target's graph of its length
        # (``full_graph_lengths``): time n one-token requests' graph where one is captured.
        dispatcher = getattr(runner, "cudagraph_dispatcher", None)
        full_graphs = getattr(dispatcher, "univer_full_graphs", None)

        def target_run(n):
            replays = full_graphs is not None and full_graphs.descriptor(n, n, 1) is not None
            with target_dummy_runs(runner, 1 if replays else None):  # the target alone, not the drafter
                runner._dummy_run(n, uniform_decode=replays)

        start_all = time.perf_counter()
        devices = [runner.device] if runner.device.type == "cuda" else []
        proposer.univer_forwards = 1  # one draft forward per dummy run (patch_proposer_dummy_run)
        try:
            with torch.random.fork_rng(devices=devices):  # vLLM seeded the generators after its warm-up
                target_run(sizes[0])
                proposer.dummy_run(sizes[0])  # warm: first calls allocate
                # Median of a few passes over the sizes: one slow run (a first call
                # at a size, the machine busy) would otherwise bend the curve.
                target = np.median(
                    [[timed(lambda n=n: target_run(n)) for n in sizes] for _ in range(CALIBRATION_PASSES)], 0
                )
                draft = np.median(
                    [[timed(lambda n=n: proposer.dummy_run(n)) for n in sizes] for _ in range(CALIBRATION_PASSES)], 0
                )
        finally:
            del proposer.univer_forwards
        self.calibration = {
            "tokens": sizes,
            "target_ms": [1e3 * float(t) for t in target],
            "draft_ms": [1e3 * float(t) for t in draft],
        }
        target_cost, draft_cost = ForwardCost(sizes, list(target)), ForwardCost(sizes, list(draft))
        self.chooser = TreeChooser(
            [
                ShapeModels(StepCostModel(target_cost, draft_cost, shape.nodes_per_depth), acceptance)
                for shape, acceptance in zip(self.shapes, self.acceptance)
            ]
        )
        logger.info("tree auto: calibrated in %.1f s: %s", time.perf_counter() - start_all, self.calibration)

    # ------------------------------------------------------------ each step
    def choose_ahead(self) -> None:
        """Make this step's choice now, while the target forward runs on the device
        (``TreeSpeculation.after_forward_launch``): the host is otherwise idle until the
        verifier reads its result, and the choice needs nothing from this step's
        verification (it learns from the steps before). ``choose`` hands it out."""
        batch = self.runner.input_batch.num_reqs
        self._ahead = (tuple(self.runner.input_batch.req_ids[:batch]), self._choose(batch))

    def choose(self, batch: int) -> tuple[TreeSpec, int | np.ndarray]:
        """(shape, depth cut) for the trees drafted now, for the ``batch`` requests
        in the runner's batch (the next step's batch, as far as anyone knows):
        the depth one int for all, or one per batch row (temperature bands of
        their own depths; the test schedule). The choice made ahead for this
        batch, if any (``choose_ahead``)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == tuple(self.runner.input_batch.req_ids[:batch]):
            self.decisions_ahead += 1
            choice = ahead[1]
        else:
            choice = self._choose(batch)
        self._drafted_before, self._drafted = self._drafted, (self._last, batch) if self._last else None
        return choice

    # -------------------------------------------------------- step periods
    # A cut's step is timed from the end of one verification to the end of the next: that
    # period runs the cut's drafting, the target forward over its trees and their
    # verification, and nothing of another cut's. (Timed between choices, which are made in
    # mid-step, a plain step after a speculating one took in the latter's verification and
    # a speculating one after plain steps left out its own: +20-30 % on plain steps at batch
    # 4 on a 2-core CPU, where speculation then looked 5-20 % ahead and lost 7 %.)
    def step_started(self) -> None:
        """The runner is about to choose and draft (its verification has run, on a
        GPU maybe not finished): what the period under way ran so far is known."""
        if self.chooser is None:
            return
        batch = self.runner.input_batch.num_reqs
        work = StepWork(int(self.runner.query_start_loc.np[batch]), list(self.drafter.forward_tokens))
        self._period = (work, self.drafter.chunk_tokens, batch)
        if self._synchronous:
            self._step_verified(self._drafted)

    def draft_launched(self) -> None:
        """The drafter has launched its forwards and waited for the verification's
        results (``TreeVerificationSampler.settle``): on a GPU the end of that verification."""
        if self.chooser is not None and not self._synchronous:
            self._step_verified(self._drafted_before)

    def _step_verified(self, drafted: tuple[Cut, int] | None) -> None:
        now = time.perf_counter()
        started, self._stamp = self._stamp, now
        if started is None or drafted is None or self._period is None:
            return
        (cut, batch), (work, chunk, period_batch) = drafted, self._period
        # A catch-up chunk ran, or requests joined (a prefill) or left: not a decode step of the cut.
        if chunk or batch != period_batch:
            return
        if not self.chooser.shapes[cut.shape].cost.is_decode_step(work, batch, cut.depth):
            return
        # No speculation is the same step whatever the shape: every shape's model learns from it.
        for s, (cost, _) in enumerate(self.chooser.shapes):
            if s == cut.shape or cut.depth == 0:
                cost.observe(cut.depth, work, now - started, batch)

    def defer(self, learn) -> None:
        """``learn()`` (observations of verified trees) is run by ``learn_deferred``:
        the runner calls it once the drafter has launched its forwards, and every
        choice first learns what is still pending."""
        self._deferred.append(learn)

    def learn_deferred(self) -> None:
        deferred, self._deferred = self._deferred, []
        for learn in deferred:
            learn()

    def _choose(self, batch: int) -> tuple[TreeSpec, int | np.ndarray]:
        self.learn_deferred()
        if self.chooser is None:  # not calibrated (warm-up skipped): speculate in full
            self.catch_up = None
            return self.tree, self.tree.max_depth
        temperature = self.runner.input_batch.temperature_cpu[:batch]
        allowed = None if len(self.shapes) == 1 or not self._has_structured_output(batch) else {len(self.shapes) - 1}
        behind, tokens_left = self._draft_backlog(batch)
        bands = _bands(temperature)
        req_ids = self.runner.input_batch.req_ids[:batch]
        live = self.runner.requests
        for acceptance in self.acceptance:
            acceptance.forget_requests_except(live)
        cut = self.chooser.choose(bands, allowed, int(behind.sum()), tokens_left, req_ids, behind)
        self._decisions += 1
        depth = cut.depth
        if self._width_schedule is not None:
            width = self._width_schedule[self._decisions % len(self._width_schedule)]
            scheduled = self._dynamic if width == 0 else self.tree.width_cut(width)
            cut = Cut(self._shape_index[scheduled] if allowed is None else cut.shape, cut.depth)
        elif self._own_depths and self.chooser.request_depths is not None:  # requests of their own depths
            depth = self.chooser.request_depths
        if self._schedule is not None:
            cycle = np.asarray(self._schedule)
            rows = np.arange(batch) if self._own_depths else np.zeros(batch, dtype=np.int64)
            depth = cycle[(self._decisions + rows) % len(cycle)]
        # The draft's catch-up this step (``TreeDrafter._catch_up``), rank 0's on every rank
        # (all must draft the same trees); under a test schedule the scheduler's token budget
        # (nothing on the clock: two engines then draft the same trees).
        scheduled = self._schedule is not None or self._width_schedule is not None
        budget = self._catch_up_budget(batch) if np.any(depth) and not scheduled else None
        if self._tp_group is not None:
            cut, depth, budget = self._tp_group.broadcast_object((cut, depth, budget), src=0)
        self.catch_up = budget
        shape = self.shapes[cut.shape]
        depths = np.minimum(np.broadcast_to(depth, (batch,)), shape.max_depth)
        self.requests_at_cut.update((shape_label(shape), d) for d in depths.tolist())
        self._last = Cut(cut.shape, int(depths.max(initial=0)))
        if self._trace is not None:
            self._write_trace(batch, behind, cut.shape, depths, budget)
        return shape, depth

    def _write_trace(self, batch, behind, shape_index, depths, budget) -> None:
        chooser = self.chooser
        shape = self.shapes[shape_index]
        record = {
            "pid": os.getpid(),  # one engine's records (several may append to one file)
            "t": time.perf_counter(),
            "verified": self._stamp,  # the end of the last verification (``step_started``)
            "batch": batch,
            "req_ids": list(self.runner.input_batch.req_ids[:batch]),
            "tokens": self.runner.input_batch.num_tokens_no_spec[:batch].tolist(),
            "target_tokens": int(self.runner.query_start_loc.np[batch]),
            "draft_tokens": list(self.drafter.forward_tokens),
            "chunk_tokens": int(self.drafter.chunk_tokens),
            "behind": behind.tolist(),
            "shape": shape_label(shape),
            "depths": depths.tolist(),
            # Target rows of this choice's verification as a decode step (more: a prefill rides it).
            "decode_rows": int(chooser.shapes[shape_index].cost.rows_through[depths].sum()),
            "catch_up": budget,
            "decisions": chooser.decisions,
            "trials": chooser.trials,
            "allowance": chooser.allowance,
            "rates": None if chooser.last_rates is None else [r.tolist() for r in chooser.last_rates],
            "priced": chooser.last_priced,  # the choice's (expected tokens, predicted seconds), if priced
            "correction": [cost.correction.round(3).tolist() for cost, _ in chooser.shapes],
            # Seconds spent so far per section, with ``VLLM_UNIVER_TIMERS=1`` (``StepTimers``).
            "timers": dict(self.drafter.timers.totals),
        }
        self._trace.write(json.dumps(record) + "\n")

    def _catch_up_budget(self, batch: int) -> int:
        """Tokens of the draft's catch-up this step may run (``TreeDrafter._catch_up``,
        ``sizing.catch_up``), by the calibrated cost model."""
        target_tokens = int(self.runner.query_start_loc.np[batch])  # this step's, prefills included
        return catch_up_budget(self.chooser.shapes[-1].cost, batch, target_tokens)

    def _draft_backlog(self, batch: int) -> tuple[np.ndarray, float]:
        """([R] tokens the draft has not run, per request; median tokens a request
        has left to generate, inf when unbounded): what speculating now first
        costs, and over how many tokens that pays back."""
        input_batch, requests = self.runner.input_batch, self.runner.requests
        req_ids = input_batch.req_ids[:batch]
        draft_kv_len = self.drafter.state.draft_kv_len
        seen = np.array([draft_kv_len.get(r, 0) for r in req_ids], dtype=np.int64)
        behind = np.maximum(input_batch.num_tokens_no_spec[:batch] - seen, 0)
        left = [
            (params.max_tokens or np.inf) - len(requests[r].output_token_ids)
            if (params := requests[r].sampling_params) is not None
            else np.inf
            for r in req_ids
        ]
        return behind, float(np.median(left)) if left else np.inf

    def _has_structured_output(self, batch: int) -> bool:
        return has_structured_output(self.runner.requests, self.runner.input_batch.req_ids[:batch])

    def observe_acceptance(self, shape: TreeSpec, temperature, cut_depths, accepted, req_ids=None) -> None:
        """Verified trees of ``shape``: their requests' temperatures, cut depths and
        accepted depths, and the requests (each learns its own acceptance)."""
        index = self._shape_index.get(shape)
        if index is not None and self._fixed_hazards is None:
            self.acceptance[index].observe(_bands(temperature), cut_depths, accepted, req_ids)

    def estimates_chain(self, shape: TreeSpec) -> bool:
        """Whether the chain's acceptance is to be estimated from verified trees of
        ``shape`` (a wider shape of this sizer, hazards learnt): ``observe_chain``."""
        index = self._shape_index.get(shape)
        # Context-aware trees: each request's own shape, which the chain estimate does not read.
        return self._chain is not None and index not in (None, self._chain) and not isinstance(shape, LevelLayout)

    def observe_chain(self, temperature, cut_depths, survival) -> None:
        """What the chain would have accepted on trees of a wider shape
        (``sizing.chain_estimate``: [R, D] estimates of P(A >= j)), their
        requests' temperatures and cut depths."""
        self.acceptance[self._chain].observe_survival(_bands(temperature), cut_depths, survival)

    @property
    def requests_at_depth(self) -> Counter:
        """Depth cut -> request-steps drafted at it, over the shapes."""
        out = Counter()
        for (_, depth), n in self.requests_at_cut.items():
            out[depth] += n
        return out

    @property
    def requests_at_width(self) -> Counter:
        """Shape's width -> speculating request-steps drafted with it (every width chosen)."""
        out = Counter()
        for (width, depth), n in self.requests_at_cut.items():
            out[width] += n if depth else 0
        return out

    def _cut_names(self) -> dict[str, int]:
        """``requests_at_cut`` as "WxD" (W: the width, or "dyn" for context-aware trees) ->
        request-steps; no speculation is "0x0" whatever the shape."""
        out = Counter()
        for (width, depth), n in self.requests_at_cut.items():
            out[f"{width if depth else 0}x{depth}"] += n
        return dict(sorted(out.items()))

    def summary(self) -> dict:
        """Steps per chosen depth, choices made (and of them, made during the target
        forward), the acceptance hazards and cost corrections (benchmarks, tests)."""
        if self.chooser is None:
            return {}
        self.learn_deferred()
        return {
            "requests_at_depth": {int(d): n for d, n in sorted(self.requests_at_depth.items())},
            "requests_at_width": dict(sorted(self.requests_at_width.items(), key=lambda item: str(item[0]))),
            "requests_at_cut": self._cut_names(),
            "decisions": self._decisions,
            "decisions_ahead": self.decisions_ahead,
            "hazards": [a.hazards().round(3).tolist() for a in self.acceptance],
            # Per shape and band: trees that informed h_1 (decayed; the chain's include its estimates).
            "evidence": [a.reached[:, 0].round(2).tolist() for a in self.acceptance],
            "cost_correction": [cost.correction.round(3).tolist() for cost, _ in self.chooser.shapes],
            "calibration": self.calibration,
        }
