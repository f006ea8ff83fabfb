"""What a decode step costs on this machine, from measurements.

A step with tree speculation cut to depth d (d = 0: no speculation) for R
requests does

* one target forward over R * (n_d + 1) query rows (n_d: tree nodes of depth <= d),
* d draft forwards (none for d = 0): level 0 over R rows (the roots; more when
  the draft cache has to catch up) and level j = 1 .. d-1 over R * w_j rows
  (w_j: tree nodes of depth j),
* the verifier and the package's bookkeeping, which the correction absorbs.

Requests of one step may be cut to different depths (``mixed_work``): the
target runs each request's own rows, the drafter's level j the requests cut
below j (``TreeDrafter`` drops a request from the levels under its cut), and
the step is corrected as a step of its deepest cut.

Each forward's time is a piecewise-linear function of its number of query
tokens, measured at start-up at a few sizes (``ForwardCost``); a correction
factor per depth, learnt from the wall-clock period of the steps actually run
against what the model predicts for the work they did, takes in what the
start-up runs leave out (attention over long contexts, sampling, verification,
the scheduler).

A speculating cut not yet run at a batch size has two estimates. The
optimistic one borrows the other sizes' correction *factor* (what speculating
adds grows like the forwards); the conservative one borrows their extra
seconds *per tree row* (it grows with the rows, as on a CPU, where the forwards
barely grow and the drafting, tree attention and verification work do). The
choice commits on the conservative one; a trial needs only its forwards' time
at the plain steps' correction (``floor_seconds``) to be worth trying.
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections import deque
from dataclasses import dataclass, field
from statistics import fmean, median

import numpy as np


class ForwardCost:
    """Seconds of one model forward as a function of its query tokens:
    piecewise linear through the measured points, extended along the last
    segment's slope beyond them."""

    def __init__(self, tokens: list[int], seconds: list[float]):
        if len(tokens) != len(seconds) or not tokens:
            raise ValueError("ForwardCost needs one time per measured size")
        # Python floats, not NumPy: the choice asks for a dozen single points per step,
        # where NumPy's per-call overhead would be most of its host time.
        order = sorted(range(len(tokens)), key=lambda i: tokens[i])
        self.tokens = [float(tokens[i]) for i in order]
        # A forward never gets cheaper with more tokens: measurement noise aside.
        self.seconds = list(itertools.accumulate((float(seconds[i]) for i in order), max))
        xs, ys = self.tokens, self.seconds
        self._slope = (ys[-1] - ys[-2]) / max(xs[-1] - xs[-2], 1.0) if len(xs) > 1 else 0.0

    def __call__(self, tokens: float) -> float:
        xs, ys = self.tokens, self.seconds
        if tokens >= xs[-1]:
            return ys[-1] + self._slope * (tokens - xs[-1])
        if tokens <= xs[0]:
            return ys[0]
        i = bisect.bisect_right(xs, tokens)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)

    def many(self, tokens: np.ndarray) -> np.ndarray:
        """The same function over an array of token counts, any shape."""
        xs, ys = self.tokens, self.seconds
        return np.where(tokens >= xs[-1], ys[-1] + self._slope * (tokens - xs[-1]), np.interp(tokens, xs, ys))


@dataclass
class StepWork:
    """The forwards one step ran: target query tokens and each draft forward's."""

    target_tokens: int
    draft_tokens: list[int] = field(default_factory=list)


# Plain steps' ratios kept: this many windows (``StepCostModel``).
PLAIN_WINDOWS = 4

# Grids of mixes whose forward seconds ``StepCostModel`` keeps (x batch compositions).
FORWARDS_CACHE_SIZE = 64


class DepthMixes:
    """K mixes of depth cuts for G groups of requests, ``depths`` [K, G] (cuts
    0 .. ``depths_per_group`` - 1), in the form that prices them at once: a sum
    over the groups of a per-group, per-depth quantity is one matrix product
    with their one-hot form [K, G * depths_per_group]."""

    def __init__(self, depths: np.ndarray, depths_per_group: int, key=None):
        self.key = key  # names a grid built once (``every``): what its pricing may be kept under
        self.depths = np.asarray(depths, dtype=np.int64)
        num_mixes, num_groups = self.depths.shape
        self.one_hot = np.zeros((num_mixes, num_groups * depths_per_group))
        self.one_hot[np.arange(num_mixes)[:, None], self.depths + depths_per_group * np.arange(num_groups)] = 1.0
        self.deepest = self.depths.max(1)

    @staticmethod
    @functools.cache
    def every(num_groups: int, depths_per_group: int) -> DepthMixes:
        """Every mix (``depths_per_group ** num_groups`` of them), built once."""
        grid = np.indices((depths_per_group,) * num_groups).reshape(num_groups, -1).T
        return DepthMixes(grid, depths_per_group, key=(num_groups, depths_per_group))

    def total(self, per_group: np.ndarray) -> np.ndarray:
        """[K, ...]: per mix, the sum over groups g of ``per_group[g, depth_g, ...]`` ([G, D+1, ...])."""
        out = self.one_hot @ per_group.reshape(self.one_hot.shape[1], -1)
        return out.reshape(len(out), *per_group.shape[2:])


def batch_bucket(num_requests: int) -> int:
    """Requests per step, bucketed by powers of two: 1, 2-3, 4-7, 8-15, ... -> 1, 2, 3, 4, ..."""
    return max(int(num_requests), 1).bit_length()


class StepCostModel:
    """Predicted seconds of a step, per depth cut, for a batch of R requests.

    depth_widths[j] = tree nodes of depth j (j = 0 is the root: 1). The
    correction of a depth is the median of the last ``window`` ratios of
    observed to predicted period at that depth, kept per batch size (powers of
    two: what a speculating step adds beyond its forwards' timing, tree attention
    and drafting overheads, grows with the batch at its own rate): one stall (a
    long prefill, an idle gap between requests) moves it not at all, a lasting
    change within ``window // 2 + 1`` steps. No speculation keeps ``PLAIN_WINDOWS``
    times as many: its price is what every speculating cut is weighed against, and
    a median of 9 moved by a spell of 5 slow plain steps (a 2-core CPU serving
    4 requests, its API server busy) priced plain steps 25 % dearer and turned
    speculation on where it lost (plain steps run often enough to follow a lasting
    change within some 20 of them).
    A speculating cut's window restarts when the cut runs again after more than
    ``window`` other steps observed by this model: otherwise a slow spell measured just before plain
    steps took over would outvote every later trial of the cut.
    """

    def __init__(self, target: ForwardCost, draft: ForwardCost, depth_widths: list[int], window: int = 9):
        self.target = target
        self.draft = draft
        self.widths = np.asarray(depth_widths, dtype=np.int64)
        self.rows_through = np.cumsum(self.widths)  # [D+1]: rows per request at depth cut d
        max_depth = len(depth_widths) - 1
        # [D+1, D]: rows of draft level j per request cut to depth d (d > j: the widths[j] nodes at depth j).
        self._deeper_widths = (np.arange(max_depth + 1)[:, None] > np.arange(max_depth)) * self.widths[:max_depth]
        self._forwards_cache: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self._corrections_cache: tuple | None = None
        self._widths, self._rows_through = self.widths.tolist(), self.rows_through.tolist()  # Python ints: host speed
        self.window = window
        # (depth cut, batch bucket) -> the last observed / predicted ratios, and the
        # last observed - predicted seconds per tree row (speculating cuts).
        self.ratios: dict[tuple[int, int], deque] = {}
        self.row_extras: dict[tuple[int, int], deque] = {}
        # Their medians, kept as they change: the choice reads them for every cut, every step.
        self._ratio_median: dict[tuple[int, int], float] = {}
        self._extra_median: dict[tuple[int, int], float] = {}
        # Steps observed so far, and the step at which each (depth cut, batch bucket) was last.
        self._steps = 0
        self.speculating_steps = 0  # of them, steps that speculated
        self._last_step: dict[tuple[int, int], int] = {}
        # The other shapes' models (``TreeChooser``): what a speculating step adds
        # beyond its forwards (tree attention, drafting, verification) is much the
        # same share for every shape, so an unseen cut borrows their evidence too.
        self.peers: list[StepCostModel] = []

    def __setattr__(self, name, value):
        if name in ("target", "draft") and hasattr(self, "_forwards_cache"):  # new timings: nothing kept holds
            self._forwards_cache.clear()
        super().__setattr__(name, value)

    def _pooled(self, depth: int) -> list[float]:
        return [x for (d, _), r in self.ratios.items() if d == depth for x in r]

    @property
    def correction(self) -> np.ndarray:
        """[D+1]: each depth's median ratio over all batch sizes (1 where nothing is seen)."""
        return np.array([median(r) if (r := self._pooled(d)) else 1.0 for d in range(len(self.widths))])

    @property
    def seen(self) -> np.ndarray:
        return np.array([bool(self._pooled(d)) for d in range(len(self.widths))])

    def is_decode_step(self, work: StepWork, num_requests: int, depth: int) -> bool:
        """Whether ``work`` is a decode step at ``depth`` and nothing more: a period
        that also ran prompt tokens (a prefill, or the draft catching up after plain
        steps: more than the root and one leaf per request at level 0) is not, and
        its time would skew the cut's correction."""
        decode = self.work(num_requests, depth)
        return work.target_tokens <= decode.target_tokens and not (
            work.draft_tokens and work.draft_tokens[0] > 2 * num_requests
        )

    def work(self, num_requests: int, depth: int) -> StepWork:
        """The forwards a step of ``num_requests`` decodes cut to ``depth`` runs."""
        return self.mixed_work([depth], [num_requests])

    def mixed_work(self, depths: list[int], counts: list[int] | None = None) -> StepWork:
        """The forwards a step runs whose groups of requests are cut to ``depths``
        [G] (0: no tree), ``counts`` [G] requests in each (None: one each): the
        target runs each request's own rows, the drafter's level j the requests
        cut below j."""
        counts = [1] * len(depths) if counts is None else counts
        target = sum(n * self._rows_through[d] for d, n in zip(depths, counts))
        # Level j's forward runs the depth-j nodes of the requests whose cut is deeper than j.
        deepest = max(depths, default=0)
        draft = [sum(n for d, n in zip(depths, counts) if d > j) * self._widths[j] for j in range(deepest)]
        return StepWork(target_tokens=target, draft_tokens=draft)

    def raw_seconds(self, work: StepWork) -> float:
        """Seconds of ``work``'s forwards as timed at start-up."""
        return self.target(work.target_tokens) + sum(self.draft(n) for n in work.draft_tokens)

    def floor_seconds(self, num_requests: int, depth: int, speculating: int | None = None) -> float:
        """Seconds of the step's forwards at the plain step's correction: what it
        would take if speculating added nothing beyond its forwards. No stale
        measurement of the cut raises it (``TreeChooser``'s trial ceiling).
        ``speculating``: requests cut to ``depth``, the others plain (None: all)."""
        speculating = num_requests if speculating is None else speculating
        work = self.mixed_work([depth, 0], [speculating, num_requests - speculating])
        return self.raw_seconds(work) * self.factor(0, num_requests)

    def seconds(self, num_requests: int, depth: int, conservative: bool = False) -> float:
        """Predicted seconds of a step of ``num_requests`` cut to ``depth``;
        ``conservative``: for a speculating cut unseen at this batch size, the
        larger of the two estimates (module docstring)."""
        mixes = DepthMixes(np.array([[depth]]), len(self._widths))
        return float(self.mixes_seconds(mixes, [num_requests], conservative)[0])

    def mixes_seconds(self, mixes: DepthMixes, counts, conservative: bool = False) -> np.ndarray:
        """[K] predicted seconds of K steps whose G groups of requests (``counts`` [G]
        requests each) are cut to ``mixes`` (``mixed_work`` of each mix, priced like
        ``seconds`` at its deepest cut), in a few array operations: the choice
        prices every mix of its groups' depths at once."""
        counts = np.asarray(counts, dtype=np.float64)
        num_requests = int(counts.sum())
        raw, tree_rows = self._mixes_forwards(mixes, counts)
        factor, extra = self._corrections(num_requests, conservative)
        seconds = raw * factor[mixes.deepest]
        if extra is not None:  # unseen speculating cuts: the larger of the two estimates
            per_row = factor[0] * raw + extra[mixes.deepest] * tree_rows
            seconds = np.where(np.isnan(per_row), seconds, np.fmax(seconds, per_row))
        return seconds

    def _mixes_forwards(self, mixes: DepthMixes, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """([K] seconds of the forwards of ``mixes`` as timed at start-up, [K] their
        tree rows). Fixed by the start-up timings: kept for the grids of every mix
        (``DepthMixes.every``) per batch composition, which repeats step after step."""
        key = None if mixes.key is None else (mixes.key, counts.tobytes())
        if key is not None and (hit := self._forwards_cache.get(key)) is not None:
            return hit
        target = mixes.total(self.rows_through * counts[:, None])  # [K]
        # Level j's forward runs the depth-j nodes of the requests cut deeper than j (none: no forward).
        draft = mixes.total(counts[:, None, None] * self._deeper_widths)  # [K, D]
        raw = self.target.many(target) + np.where(draft > 0, self.draft.many(draft), 0.0).sum(1)
        out = (raw, target - counts.sum())
        if key is not None:
            if len(self._forwards_cache) >= FORWARDS_CACHE_SIZE:
                self._forwards_cache.pop(next(iter(self._forwards_cache)))
            self._forwards_cache[key] = out
        return out

    def _corrections(self, num_requests: int, conservative: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """([D+1] the correction factor of each deepest cut, [D+1] the conservative
        seconds per tree row of each (NaN: none), or None), for a batch of
        ``num_requests``; looked up once per observation of this model or its peers."""
        stamp = (batch_bucket(num_requests), conservative, self._steps, *(peer._steps for peer in self.peers))
        if self._corrections_cache is not None and self._corrections_cache[0] == stamp:
            return self._corrections_cache[1]
        max_depth = len(self._widths) - 1
        factor = np.array([self.factor(d, num_requests) for d in range(max_depth + 1)])
        extra = None
        if conservative:
            bucket = stamp[0]
            extra = np.array(
                [
                    e if d and (d, bucket) not in self.ratios and (e := self._row_extra(d)) is not None else np.nan
                    for d in range(max_depth + 1)
                ]
            )
            extra = None if np.isnan(extra).all() else extra
        self._corrections_cache = (stamp, (factor, extra))
        return factor, extra

    def _row_extra(self, depth: int) -> float | None:
        """Seconds a speculating step took beyond its prediction, per tree row: this
        shape's evidence at ``depth``, else at any depth, else the other shapes'."""
        for models, same_depth in (([self], True), ([self], False), (self.peers, False)):
            seen = [m for model in models for (d, _), m in model._extra_median.items() if d == depth or not same_depth]
            if seen:
                return float(fmean(seen))
        return None

    def catch_up_seconds(self, num_requests: int, backlog_tokens: int) -> float:
        """One-off seconds of the draft's level-0 forward running ``backlog_tokens``
        it has not seen (prompts, tokens of plain steps) besides the roots."""
        if backlog_tokens <= 0:
            return 0.0
        return self.draft(num_requests + backlog_tokens) - self.draft(num_requests)

    def observe(self, depth: int, work: StepWork, seconds: float, num_requests: int = 1) -> None:
        """A step of ``num_requests`` cut to ``depth`` that did ``work`` took ``seconds`` of wall clock."""
        predicted = self.raw_seconds(work)
        if predicted > 0 and np.isfinite(seconds) and seconds > 0:
            key = (depth, batch_bucket(num_requests))
            self._steps += 1
            if depth > 0 and self._steps - self._last_step.get(key, self._steps) > self.window:
                # A speculating cut last run more than a window of steps ago (it is run
                # again after plain steps, or tried): its ratios describe another spell.
                # A pessimistic one would otherwise outvote the new steps until they fill
                # half the window, and trials that far apart take hundreds of steps to.
                for kept in (self.ratios, self.row_extras, self._ratio_median, self._extra_median):
                    kept.pop(key, None)
            self._last_step[key] = self._steps
            self.speculating_steps += depth > 0
            kept = self.window * (PLAIN_WINDOWS if depth == 0 else 1)
            ratios = self.ratios.setdefault(key, deque(maxlen=kept))
            ratios.append(seconds / predicted)
            self._ratio_median[key] = float(median(ratios))
            tree_rows = work.target_tokens - num_requests
            if depth > 0 and tree_rows > 0:
                # Beyond what the same forwards would take in a plain step.
                extra = seconds - predicted * self.factor(0, num_requests)
                extras = self.row_extras.setdefault(key, deque(maxlen=self.window))
                extras.append(extra / tree_rows)
                self._extra_median[key] = float(median(extras))

    def factor(self, depth: int, num_requests: int = 1) -> float:
        bucket = batch_bucket(num_requests)
        if (own := self._ratio_median.get((depth, bucket))) is not None:
            return own
        plain = self._pooled(0)
        # Not run yet at this cut and batch size. A plain step (depth 0): what plain
        # steps of other sizes say, else what the start-up runs timed (1). A
        # speculating cut: what the speculating cuts run at this batch size, of this
        # shape, else of any shape, say about the model's bias (the drafting and
        # verification overheads the forward timings leave out), else at any size,
        # else what plain steps say.
        if depth == 0:
            return float(median(plain)) if plain else 1.0
        for same_size, models in ((True, [self]), (True, self.peers), (False, [self]), (False, self.peers)):
            seen = [
                m
                for model in models
                for (d, b), m in model._ratio_median.items()
                if d > 0 and (b == bucket or not same_size)
            ]
            if seen:
                return float(fmean(seen))
        return float(median(plain)) if plain else 1.0
