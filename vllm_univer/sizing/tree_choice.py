"""The cut of the tree that maximises tokens per second for the batch at hand.

Candidates are the depth cuts 0 .. D of each *shape*: the configured tree and
its width cuts (``TreeSpec.width_cuts``: for ``2x5`` the chain ``1x5`` and
``2x5`` itself). Depth 0 is no speculation, a plain decode step: no draft
forward, one target row per request. All requests of a step share the shape;
the choice is

    argmax_(s, d)  sum_r E[tokens_r | s, d] / seconds(R, s, d),

each shape with its own cost model (its rows per depth) and acceptance model
(its hazards per depth), with a little exploration: every ``explore_every``
decisions one other cut is tried in turn (no speculation, the next deeper
cut of the chosen shape, the best cut of each other shape), so the
estimates of cuts that are not chosen stay current; but never a speculating
cut that could not beat the chosen one even if every draft were accepted, so
where drafting cannot pay (a compute-bound CPU) no step ever speculates. A
plain step is always worth a try now and then: its cost is the one that
speculating steps' measurements say least about (theirs carry the drafting
and verification overheads, a plain step's do not). A speculating cut tried
and not chosen waits twice as long before its next trial (up to
``MAX_BACKOFF`` explorations): where speculating steps cost several plain
ones, exploring them must stay rare. The waits are kept per batch size (the
cost model's buckets): a cut that never paid at batch 16 is tried at once
when the load drops to one request, where it may well pay.

Speculating after plain steps first costs a catch-up: the draft runs every
token it has not seen (the prompts of new requests, the tokens of plain
steps) in its level-0 forward. The choice spreads that one-off cost over the
steps left to the requests (their ``max_tokens``); a trial, which may not be
repeated, is charged all of it. A trial from plain steps runs two steps: the
first carries the catch-up, which the cost model leaves unmeasured, so the
second is the one that measures the cut (without it, trials from plain steps
would never correct a cut's cost, and a slow spell could keep speculation
off for good).

Requests that accept differently get depths of their own (``request_depths``):
greedy requests, whose drafts the target keeps more often, may go deeper than
hot ones in the same step, or speculate alone while the hot ones run plain;
within a band, a request whose drafts are kept more often (code beside chat)
may go deeper than the others. Each request is valued by its own acceptance
(``AcceptanceModel.expected_tokens`` with its id: its band's, updated by its
own trees); requests are put in at most ``MAX_GROUPS`` groups of alike
acceptance (``acceptance_groups``), and in the shape of the best cut of one
depth for all, the mix of group depths that maximises the batch's rate is
found among every mix (4 groups: 1296 mixes for a depth-5 tree, priced in one
pass of array operations; coordinate ascent beyond ``EXHAUSTIVE_MIXES``),
priced like the rates above (``StepCostModel.mixes_seconds``: each request's
own target rows, the drafter's levels down to each request's cut, the deepest
cut's correction). Trials keep one depth for all: they measure the cut.

A clear "no speculation" (every cut, every mix of group depths, at least
10 % below a plain step's rate: ``SETTLED_BELOW``) is kept for
``SETTLED_DECISIONS`` decisions without pricing anything, while the batch's
size bucket, temperature bands and allowed shapes stay, no model learns from
a speculating step and no exploration is due: a plain step must cost what a
plain engine's does (on a GPU a few ms, against some 0.4 ms of host time to
price every cut). Any priced choice, its requests' depths with it, is kept for
the next ``REPRICE_EVERY`` - 1 decisions of the same batch (the same requests,
allowed shapes, no catch-up to run; for no speculation, nothing learnt since
from a speculating step), unless an exploration is due: the estimates move by
a fraction of a percent per step.

A cut is committed to on the cost model's conservative
estimate (``StepCostModel.seconds``), and only if it beats no speculation by
``SPECULATION_MARGIN``; it is tried if it could beat the choice with its
forwards' time alone (``StepCostModel.floor_seconds``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .acceptance_model import AcceptanceModel, children_per_node, share_priors
from .cost_model import DepthMixes, StepCostModel, batch_bucket

# The longest wait between two trials of one cut, in explorations (x explore_every decisions).
MAX_BACKOFF = 64
# A speculating cut is chosen only if its expected rate beats no speculation by this
# much: near a tie, the cost and acceptance estimates' errors (a few % each) decide,
# and what the model leaves out falls on speculation's side (the straggler steps of
# a batch whose requests end at different steps, a catch-up priced on a short
# history). Measured on a 2-core CPU at batch 8, T = 1, 32 tokens: depth 1 predicted
# +4-6 % per step (+2-3 % as run), -14 to -25 % end to end; where trees pay (batch 1) the
# predicted gain is +20-40 %.
SPECULATION_MARGIN = 0.10
# A choice of no speculation with every speculating cut's rate below this share of a
# plain step's is kept for up to SETTLED_DECISIONS decisions without pricing anything
# (unless the batch's size bucket or temperature bands change, a model learns from a
# speculating step, or an exploration is due): on a GPU a plain step takes a few ms, and
# pricing every cut again (some 0.4 ms of host time) would make tree "auto" slower than
# no speculation exactly where it does not speculate.
SETTLED_BELOW = 0.9
SETTLED_DECISIONS = 8
# A priced choice (its cut and its requests' depths) is kept for the next
# REPRICE_EVERY - 1 decisions of the same batch (the same requests in the same rows,
# the same allowed shapes), unless an exploration is due: the estimates it rests on
# move by a fraction of a percent per step (acceptance forgets 0.5 % per tree, cost
# corrections are medians of several steps), and pricing every cut and mix of depths
# again costs some 0.3-0.5 ms of host time per step, several % of a GPU decode step.
REPRICE_EVERY = 4
# Requests get a depth per group of alike acceptance: at most this many groups.
MAX_GROUPS = 4
# Requests whose expected tokens per step at the full depth differ by less never split into groups.
GROUP_GAP = 0.05
# A batch's groups of requests get the best mix of depths of all when there are at most
# this many (4 groups x a depth-5 tree: 6^4 = 1296, priced in one pass), else coordinate ascent.
EXHAUSTIVE_MIXES = 4096


def catch_up_per_step(catch_up_seconds: float, tokens_left: float, num_requests: int, tokens_per_step):
    """The draft's one-off catch-up spread over the steps a speculating cut that
    yields ``tokens_per_step`` (the batch's; a float or an array of cuts) takes for
    the ``tokens_left`` each of the ``num_requests`` requests has left (at least one)."""
    return catch_up_seconds / np.maximum(tokens_left * num_requests / tokens_per_step, 1.0)


class ShapeModels(NamedTuple):
    """What the choice knows about one shape: its step costs and its acceptance."""

    cost: StepCostModel
    acceptance: AcceptanceModel


class Cut(NamedTuple):
    """A candidate tree: shape index (into the chooser's shapes) and depth cut (0: no speculation)."""

    shape: int
    depth: int


class KeptChoice(NamedTuple):
    """A choice kept without pricing while ``key`` holds, up to decision ``until`` (exclusive)."""

    key: tuple
    until: int
    cut: Cut
    request_depths: np.ndarray | None


class TreeChooser:
    def __init__(self, shapes: list[ShapeModels], explore_every: int = 16, reprice_every: int = REPRICE_EVERY):
        if not shapes:
            raise ValueError("TreeChooser needs at least one shape")
        self.shapes = shapes
        for models in shapes:
            models.cost.peers = [other.cost for other in shapes if other is not models]
        self.explore_every = explore_every
        self.reprice_every = reprice_every  # 1: every decision priced afresh
        self.decisions = 0
        self._explored = 0  # round-robin index over the exploration candidates
        # Per (batch bucket, speculating cut) tried and not chosen: explorations to wait
        # before the next trial (doubling), and the decision from which it may be tried again.
        self._backoff: dict[tuple[int, Cut], int] = {}
        self._eligible_from: dict[tuple[int, Cut], int] = {}
        self._follow_up: tuple[int, Cut] | None = None  # (batch bucket, cut): a trial's second step
        # A clear "no speculation" (``SETTLED_DECISIONS``), keyed by the situation: batch
        # bucket, bands, allowed shapes, evidence.
        self._settled: KeptChoice | None = None
        # The last priced choice (``REPRICE_EVERY``), keyed by the batch (requests or bands,
        # allowed shapes, a catch-up to run) and, for no speculation, the evidence.
        self._recent: KeptChoice | None = None
        # [R]: each request's depth in the last choice (groups of requests of their own
        # depths), or None: every request at the cut's depth (one band, no speculation, a trial).
        self.request_depths: np.ndarray | None = None

    def _evidence(self) -> tuple[int, ...]:
        """Counts that change when a model learns what a speculating step says:
        the acceptance models' observations and the cost models' speculating steps
        (plain steps' periods, measured every plain step, are left out)."""
        return tuple(a.observations for _, a in self.shapes) + tuple(c.speculating_steps for c, _ in self.shapes)

    def rates(self, bands, backlog: int = 0, tokens_left: float = np.inf, req_ids=None) -> list[np.ndarray]:
        """Per shape, [D+1]: expected tokens per second of the batch at every depth
        cut, on the conservative step costs, each speculating cut charged the
        draft's catch-up over ``backlog`` tokens spread over the steps that
        ``tokens_left`` (per request) take at that cut. ``req_ids``: each
        request valued by its own acceptance (None: its band's)."""
        return self._rates(self._request_tokens(bands, req_ids), backlog, tokens_left)

    def _request_tokens(self, bands, req_ids) -> list[np.ndarray]:
        """Per shape, [R, D+1]: each request's expected tokens per step at every depth cut."""
        if len(self.shapes) > 1:  # a shape rarely drafted learns from the others first
            share_priors([a for _, a in self.shapes], [children_per_node(c.widths) for c, _ in self.shapes])
        return [acceptance.expected_tokens(bands, req_ids) for _, acceptance in self.shapes]

    def _rates(self, request_tokens: list[np.ndarray], backlog: int, tokens_left: float) -> list[np.ndarray]:
        out = []
        for (cost, _), per_request in zip(self.shapes, request_tokens):
            reqs = len(per_request)
            tokens = per_request.sum(0)
            seconds = cost.mixes_seconds(DepthMixes.every(1, len(tokens)), [reqs], conservative=True)
            seconds[1:] += catch_up_per_step(cost.catch_up_seconds(reqs, backlog), tokens_left, reqs, tokens[1:])
            out.append(tokens / seconds)
        return out

    def choose(
        self, bands, allowed: set[int] | None = None, backlog: int = 0, tokens_left: float = np.inf, req_ids=None
    ) -> Cut:
        """The cut for a step whose requests are in temperature ``bands``, among
        the shapes ``allowed`` (indices; None: all). ``backlog``: tokens the
        draft has not seen beyond one per request (what speculating now must
        first run through it); ``tokens_left``: tokens each request has left to
        generate, as far as known (typical of the batch); ``req_ids``: the
        requests, each valued by its own acceptance (None: by its band's)."""
        reqs = len(bands)
        last = len(self.shapes) - 1
        if reqs == 0:
            return Cut(last, 0)
        bucket = batch_bucket(reqs)
        follow_up, self._follow_up = self._follow_up, None
        if follow_up is not None and follow_up[0] == bucket and (allowed is None or follow_up[1].shape in allowed):
            self.decisions += 1  # a trial's second step, at the batch size it was tried at
            self.request_depths = None
            return follow_up[1]
        situation = (bucket, frozenset(np.asarray(bands).tolist()), allowed and frozenset(allowed), self._evidence())
        exploring = self.explore_every and (self.decisions + 1) % self.explore_every == 0
        # A clear "no speculation", nothing learnt since: priced again later.
        if (kept := self._kept(self._settled, situation, exploring)) is not None:
            return kept
        self._settled = None
        # Priced a step or three ago, for the same requests. A catch-up to run (new tokens
        # the draft has not seen) prices afresh: it may change the choice. No speculation is
        # priced again as soon as a model learns from a speculating step (a trial's): unlike
        # a speculating cut's, its evidence changes rarely.
        requests = np.asarray(bands).tobytes() if req_ids is None else tuple(req_ids)
        batch = (requests, allowed and frozenset(allowed), backlog > 0)
        recent_key = (batch, situation[3] if self._recent is not None and self._recent.cut.depth == 0 else None)
        if (kept := self._kept(self._recent, recent_key, exploring)) is not None:
            return kept
        self._recent = None
        request_tokens = self._request_tokens(bands, req_ids)
        rates = self._rates(request_tokens, backlog, tokens_left)
        if allowed is not None:
            rates = [r if s in allowed else r[:1] for s, r in enumerate(rates)]  # depth 0 is any shape's
        best = max(
            ((s, int(np.argmax(r[1:])) + 1) for s, r in enumerate(rates) if len(r) > 1),
            key=lambda c: rates[c[0]][c[1]],
            default=None,
        )
        plain = max(r[0] for r in rates)  # no speculation: every shape's model of the same step
        best_rate = rates[best[0]][best[1]] if best is not None else 0.0
        per_request = None
        if best is not None and reqs > 1:
            # Requests that accept alike share a depth: at most MAX_GROUPS groups.
            tokens = request_tokens[best[0]]
            group = acceptance_groups(tokens[:, -1])
            if group.max() > 0:
                num_groups = int(group.max()) + 1
                group_tokens = np.zeros((num_groups, tokens.shape[1]))
                np.add.at(group_tokens, group, tokens)
                counts = np.bincount(group, minlength=num_groups)
                group_rate, depths = self._group_depths(Cut(*best), group_tokens, counts, backlog, tokens_left)
                if group_rate > best_rate and max(depths) > 0:
                    best, best_rate = (best[0], max(depths)), group_rate
                    per_request = np.asarray(depths, dtype=np.int64)[group]
        speculate = best is not None and best_rate > plain * (1 + SPECULATION_MARGIN)
        choice = Cut(*best) if speculate else Cut(last, 0)
        if choice.depth == 0 and allowed is not None:
            choice = Cut(min(allowed), 0)
        rate = best_rate if choice.depth else plain
        if choice.depth == 0 and best_rate < plain * SETTLED_BELOW:
            self._settled = KeptChoice(situation, self.decisions + 1 + SETTLED_DECISIONS, choice, None)
        self.request_depths = per_request if speculate else None
        self._backoff.pop((bucket, choice), None)  # a cut that pays is tried freely again once it stops paying
        self.decisions += 1
        evidence = situation[3] if choice.depth == 0 else None
        until = self.decisions + self.reprice_every - 1
        self._recent = KeptChoice((batch, evidence), until, choice, self.request_depths)
        if self.explore_every and self.decisions % self.explore_every == 0:
            candidates = [
                c
                for c in self._exploration_candidates(choice, rates)
                if self._eligible_from.get((bucket, c), 0) <= self.decisions
            ]
            if candidates:
                trial = candidates[self._explored % len(candidates)]
                self._explored += 1
                # Every draft accepted: depth + 1 tokens per request, in the time of the
                # step's forwards alone plus the whole catch-up it first costs. Not the
                # cut's own correction: a pessimistic one from a slow spell would bar the
                # trials that are to correct it.
                cost = self.shapes[trial.shape].cost
                seconds = cost.floor_seconds(reqs, trial.depth) + cost.catch_up_seconds(reqs, backlog)
                ceiling = reqs * (trial.depth + 1) / seconds
                if trial.depth == 0 or ceiling > rate:
                    if trial.depth > 0 and choice.depth == 0:
                        # From plain steps the trial's step runs the draft's catch-up, which
                        # the cost model does not measure (``is_decode_step``): its second
                        # step is the one that says what the cut costs.
                        self._follow_up = (bucket, trial)
                    choice, self.request_depths, self._settled, self._recent = trial, None, None, None
                if trial.depth > 0:
                    wait = self._backoff.get((bucket, trial), 1)
                    self._eligible_from[bucket, trial] = self.decisions + wait * self.explore_every
                    self._backoff[bucket, trial] = min(2 * wait, MAX_BACKOFF)
        return choice

    def _kept(self, kept: KeptChoice | None, key: tuple, exploring: bool) -> Cut | None:
        """``kept``'s cut (and its requests' depths, as this decision's) if it holds for
        ``key`` at this decision and no exploration is due, else None."""
        if kept is None or exploring or kept.key != key or self.decisions >= kept.until:
            return None
        self.decisions += 1
        self.request_depths = kept.request_depths
        return kept.cut

    def _group_depths(
        self, start: Cut, tokens: np.ndarray, counts: np.ndarray, backlog: int, tokens_left: float
    ) -> tuple[float, list[int]]:
        """(rate, [G] depths) of ``start``'s shape with a depth per group of requests
        (``tokens`` [G, D+1] their expected tokens per step at each cut, summed
        over the ``counts`` [G] requests of each) that maximises the batch's
        expected tokens per second (priced like ``rates``; of equal rates, the
        fewest target rows: no rows for nothing, for a group whose drafts are
        never kept). Every mix of depths is priced at once when there are at most
        ``EXHAUSTIVE_MIXES``; beyond, coordinate ascent from ``start.depth`` for
        every group, each in turn set to its best depth given the others'."""
        cost, _ = self.shapes[start.shape]
        num_groups, depths_per_group = tokens.shape
        reqs = int(counts.sum())
        catch_up = cost.catch_up_seconds(reqs, backlog)
        rows = cost.rows_through * counts[:, None]  # [G, D+1] target rows of each group at each depth

        def best_of(mixes: DepthMixes) -> tuple[float, np.ndarray]:
            """The best of ``mixes``: (its rate, its depths [G])."""
            expected = mixes.total(tokens)  # [K]
            seconds = cost.mixes_seconds(mixes, counts, conservative=True)
            seconds += np.where(mixes.deepest > 0, catch_up_per_step(catch_up, tokens_left, reqs, expected), 0.0)
            rate = expected / seconds
            near_best = rate >= rate.max() * (1 - 1e-9)
            k = int(np.argmin(np.where(near_best, mixes.total(rows), np.inf)))
            return float(rate[k]), mixes.depths[k]

        if depths_per_group**num_groups <= EXHAUSTIVE_MIXES:
            best, depths = best_of(DepthMixes.every(num_groups, depths_per_group))
            return best, depths.tolist()
        depths = np.full(num_groups, start.depth)
        best, _ = best_of(DepthMixes(depths[None], depths_per_group))
        for _ in range(num_groups + 1):
            moved = False
            for g in range(num_groups):
                candidates = np.repeat(depths[None], depths_per_group, 0)
                candidates[:, g] = np.arange(depths_per_group)
                rate, mix = best_of(DepthMixes(candidates, depths_per_group))
                if rate > best * (1 + 1e-9) or (mix[g] < depths[g] and rate >= best * (1 - 1e-9)):
                    best, depths, moved = rate, mix, True
            if not moved:
                break
        return best, depths.tolist()

    def _exploration_candidates(self, choice: Cut, rates: list[np.ndarray]) -> list[Cut]:
        """No speculation, the next deeper cut of the chosen shape, each other shape's best cut."""
        candidates = [Cut(len(self.shapes) - 1, 0)] if choice.depth > 0 else []
        if choice.depth + 1 < len(rates[choice.shape]):
            candidates.append(Cut(choice.shape, choice.depth + 1))
        for s, r in enumerate(rates):
            if s != choice.shape and len(r) > 1:
                candidates.append(Cut(s, int(np.argmax(r[1:])) + 1))
        return candidates


def acceptance_groups(expected: np.ndarray, max_groups: int = MAX_GROUPS, min_gap: float = GROUP_GAP) -> np.ndarray:
    """[R] group (0 .. G-1, in increasing ``expected``) of each request, from
    ``expected`` [R], its expected tokens per step at the full depth: the
    requests in that order, split at the ``max_groups - 1`` largest gaps wider
    than ``min_gap``."""
    order = np.argsort(expected, kind="stable")
    gaps = np.diff(expected[order])
    splits = np.argsort(-gaps, kind="stable")[: max_groups - 1]
    splits = splits[gaps[splits] > min_gap]
    starts = np.zeros(len(expected), dtype=np.int64)
    starts[splits + 1] = 1
    group = np.empty(len(expected), dtype=np.int64)
    group[order] = np.cumsum(starts)
    return group
