"""The cut of the tree that maximises tokens per second for the batch at hand.

Candidates are the depth cuts 0 .. D of each *shape*: the configured tree and
its width cuts (``TreeSpec.width_cuts``: for ``2x5`` the chain ``1x5`` and
``2x5`` itself). Depth 0 is no speculation, a plain decode step: no draft
forward, one target row per request. All requests of a step share the shape;
the choice is

    argmax_(s, d)  sum_r E[tokens_r | s, d] / seconds(R, s, d),

each shape with its own cost model (its rows per depth) and acceptance model
(its hazards per depth).

Exploration is priced. Every decision adds ``EXPLORE_SHARE`` (1 %) of the
chosen step's predicted time to an allowance; a trial runs when the allowance
covers what it is predicted to lose against the choice (its step's time
against the time the choice takes for the tokens it yields, plus the draft's
catch-up it runs), and that loss is taken off. So exploring never costs more
than 1 % of the time served, yet a cut whose estimate is wrong (a slow spell
measured, a load that changed) is tried again after a bounded wait: the
loss over 2 % of a step's time, in steps. Candidates: from plain steps, the
best speculating cut for *one* request (the one with the fewest tokens
behind in the draft: under load one request's catch-up is cheap, the batch's
is not) — it lasts until that request has caught up and drafted a tree, the
step that measures the cut; while speculating, in turn, no speculation, the
next deeper cut of the chosen shape and each other shape's best cut, one
step each. Never a speculating cut that could not beat the choice even if
every draft were accepted, in its forwards' time alone
(``StepCostModel.floor_seconds``): where drafting cannot pay (a
compute-bound CPU) no step ever speculates.

Speculating after plain steps first costs a catch-up: the draft runs every
token it has not seen (the prompts of new requests, the tokens of plain
steps), a bounded chunk per step (``sizing.catch_up``). The choice spreads that
one-off cost over the steps left to the requests (their ``max_tokens``); a
trial is charged all of it.

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
a speculating step and no trial is affordable: a plain step must cost what a
plain engine's does (on a GPU a few ms, against some 0.4 ms of host time to
price every cut, ``benchmarks/sizer_overhead.py``). Any priced choice, its
requests' depths with it, is kept for the next ``REPRICE_EVERY`` - 1
decisions of the same batch (the same requests, allowed shapes, no catch-up
to run; for no speculation, nothing learnt since from a speculating step),
unless a trial is affordable: the estimates move by a fraction of a percent
per step.

A cut is committed to on the cost model's conservative
estimate (``StepCostModel.seconds``), and only if it beats no speculation by
``SPECULATION_MARGIN``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .acceptance_model import AcceptanceModel, children_per_node, share_priors
from .cost_model import DepthMixes, StepCostModel, batch_bucket

# Exploration spends at most this share of the time served (the allowance, ``TreeChooser``).
EXPLORE_SHARE = 0.01
# The allowance holds at most this many decisions' worth of its share: no burst of
# trials after a long quiet spell, and a trial that costs more than that many decisions'
# share never runs (where one is that expensive, speculation cannot be close to paying).
ALLOWANCE_DECISIONS = 1000
# The least a trial is priced at, in steps of the choice's (``_next_trial``).
MIN_TRIAL_PRICE = 0.5
# A trial of one request from plain steps lasts until it has caught up and drafted, at most this many decisions.
MAX_TRIAL_DECISIONS = 64
# A speculating cut is chosen only if its expected rate beats no speculation by this
# much: near a tie, the cost and acceptance estimates' errors (a few % each) decide.
# 10 % while catch-ups ran whole and trials backed off (measured then on a 2-core CPU at
# batch 8: depth 1 predicted +4-6 %, -14 to -25 % end to end);
# in the simulated engine (``tests/sizing/test_simulated_engine.py``) 5 % reaches 95 % of
# the best fixed cut where trees pay 1.2-1.7x and never costs more than 2 % where they
# do not pay, where 10 % left 6 % on the table on a machine where trees pay 1.2x.
SPECULATION_MARGIN = 0.05
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


class Trial(NamedTuple):
    """A trial from plain steps: request ``request`` (None: every request) at ``cut``,
    until it has caught up and drafted, at most up to decision ``until`` (exclusive)."""

    request: str | None
    cut: Cut
    until: int


class TreeChooser:
    def __init__(
        self, shapes: list[ShapeModels], explore_share: float = EXPLORE_SHARE, reprice_every: int = REPRICE_EVERY
    ):
        if not shapes:
            raise ValueError("TreeChooser needs at least one shape")
        self.shapes = shapes
        for models in shapes:
            models.cost.peers = [other.cost for other in shapes if other is not models]
        self.explore_share = explore_share  # 0: no exploration
        self.reprice_every = reprice_every  # 1: every decision priced afresh
        self.decisions = 0
        self.trials = 0
        self._explored = 0  # round-robin index over the candidates of trials from a speculating choice
        # Seconds of exploration earned and not spent; the predicted seconds of the last priced
        # choice's step (what each decision earns a share of), and the loss of the next trial.
        self.allowance = 0.0
        self._step_seconds = 0.0
        self._trial_loss = np.inf
        self._trial: Trial | None = None
        # A clear "no speculation" (``SETTLED_DECISIONS``), keyed by the situation: batch
        # bucket, bands, allowed shapes, evidence.
        self._settled: KeptChoice | None = None
        # The last priced choice (``REPRICE_EVERY``), keyed by the batch (requests or bands,
        # allowed shapes, a catch-up to run) and, for no speculation, the evidence.
        self._recent: KeptChoice | None = None
        # [R]: each request's depth in the last choice (groups of requests of their own
        # depths, a trial of one request), or None: every request at the cut's depth.
        self.request_depths: np.ndarray | None = None
        # Per shape, [D+1]: the rates the last priced decision compared (None: kept, or none
        # priced yet), its own request depths' mix aside (``TreeSizer``'s trace).
        self.last_rates: list[np.ndarray] | None = None
        # The last priced choice's (expected tokens, predicted seconds with its catch-up spread in).
        self.last_priced: tuple[float, float] | None = None

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
        self,
        bands,
        allowed: set[int] | None = None,
        backlog: int = 0,
        tokens_left: float = np.inf,
        req_ids=None,
        behind: np.ndarray | None = None,
    ) -> Cut:
        """The cut for a step whose requests are in temperature ``bands``, among
        the shapes ``allowed`` (indices; None: all). ``backlog``: tokens the
        draft has not seen beyond one per request (what speculating now must
        first run through it), ``behind`` [R] the same per request (None: not
        known); ``tokens_left``: tokens each request has left to generate, as far
        as known (typical of the batch); ``req_ids``: the requests, each valued by
        its own acceptance (None: by its band's)."""
        reqs = len(bands)
        last = len(self.shapes) - 1
        self.last_rates = self.last_priced = None
        if reqs == 0:
            return Cut(last, 0)
        self.allowance = min(
            self.allowance + self.explore_share * self._step_seconds,
            ALLOWANCE_DECISIONS * self.explore_share * self._step_seconds,
        )
        if (trial := self._go_on_with_trial(reqs, allowed, backlog, req_ids, behind)) is not None:
            return trial
        bucket = batch_bucket(reqs)
        situation = (bucket, frozenset(np.asarray(bands).tolist()), allowed and frozenset(allowed), self._evidence())
        exploring = self.allowance >= self._trial_loss
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
        rates = self.last_rates = self._rates(request_tokens, backlog, tokens_left)
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
        tokens = request_tokens[choice.shape] if choice.depth else None
        expected_tokens = reqs if choice.depth == 0 else per_request_total(tokens, per_request, choice.depth)
        self._step_seconds = expected_tokens / rate
        self.last_priced = (expected_tokens, self._step_seconds)
        if choice.depth == 0 and best_rate < plain * SETTLED_BELOW:
            self._settled = KeptChoice(situation, self.decisions + 1 + SETTLED_DECISIONS, choice, None)
        self.request_depths = per_request if speculate else None
        self.decisions += 1
        evidence = situation[3] if choice.depth == 0 else None
        until = self.decisions + self.reprice_every - 1
        self._recent = KeptChoice((batch, evidence), until, choice, self.request_depths)
        if self.explore_share:
            trial = self._next_trial(choice, rate, rates, request_tokens, backlog, req_ids, behind, best)
            if trial is not None:
                self._settled = self._recent = None
                return self._start_trial(*trial, reqs, req_ids)
        return choice

    def _next_trial(self, choice, rate, rates, request_tokens, backlog, req_ids, behind, best):
        """(cut, row or None: every request, its predicted loss, whether it goes on over
        later decisions) of the trial due now, or None. Sets the loss the allowance must
        reach for the next one (``_trial_loss``)."""
        reqs = len(request_tokens[0])
        self._trial_loss = np.inf
        if choice.depth == 0:
            if best is None:
                return None
            cut = Cut(*best)
            # One request: the one whose draft is the least behind.
            row = int(np.argmin(behind)) if behind is not None and req_ids is not None else None
            count = 1 if row is not None else reqs
            catch_up = int(behind[row]) if row is not None else backlog
            expected = request_tokens[cut.shape][row if row is not None else slice(None), cut.depth].sum()
        else:
            options = self._exploration_candidates(choice, rates)
            cut, row, count, catch_up = options[self._explored % len(options)], None, reqs, 0
            expected = request_tokens[cut.shape][:, cut.depth].sum() if cut.depth else reqs
        cost = self.shapes[cut.shape].cost
        mix = DepthMixes(np.array([[cut.depth, 0]]), len(cost.widths))
        counts = [count, reqs - count]
        # In full: where the cut does not pay, it is lost. (A request the draft falls behind
        # on faster than the allowance grows is tried again once a new one comes.)
        catch_up_seconds = cost.catch_up_seconds(count, catch_up)
        # Every draft accepted, in its forwards' time alone (the plain correction): a trial
        # that cannot beat the choice even so is not worth running. (One request's trial is
        # judged as run: the step it measures is the cut for that request, the others plain.)
        if cut.depth and (reqs + count * cut.depth) / cost.floor_seconds(reqs, cut.depth, count) <= rate:
            return None
        seconds = float(cost.mixes_seconds(mix, counts, conservative=True)[0]) + catch_up_seconds
        others = reqs - count
        # At least MIN_TRIAL_PRICE of a step: a cut whose estimate is that close to the
        # choice's is within the estimates' noise, and trials priced at nothing would
        # take every other step.
        loss = max(seconds - (expected + others) / rate, MIN_TRIAL_PRICE * self._step_seconds)
        self._trial_loss = loss
        if self.allowance < loss:
            return None
        # From plain steps, a request (or batch) the draft is behind on: the trial goes on until
        # it has caught up (its first steps run the catch-up, which the cost model does not
        # measure) and drafted.
        behind_draft = catch_up > (count if row is None else 1)
        return cut, row, loss, choice.depth == 0 and behind_draft

    def _start_trial(self, cut: Cut, row: int | None, loss: float, go_on: bool, reqs: int, req_ids) -> Cut:
        self.allowance -= loss
        self._trial_loss = np.inf
        self.trials += 1
        self.request_depths = None
        if row is not None:
            self.request_depths = np.zeros(reqs, dtype=np.int64)
            self.request_depths[row] = cut.depth
        if go_on:
            request = None if row is None else req_ids[row]
            self._trial = Trial(request, cut, self.decisions + MAX_TRIAL_DECISIONS)
        else:
            self._explored += 1
        return cut

    def _go_on_with_trial(self, reqs, allowed, backlog, req_ids, behind) -> Cut | None:
        """The cut of the trial under way, its request (or the batch) behind the draft
        still, or None (none, or over: it drafted, its request left, it ran out of decisions)."""
        trial, self._trial = self._trial, None
        if trial is None or self.decisions >= trial.until or (allowed is not None and trial.cut.shape not in allowed):
            return None
        if trial.request is None:
            caught_up = backlog <= reqs  # every request's draft KV up to its root (``TreeSizer._draft_backlog``)
            self.request_depths = None
        else:
            if req_ids is None or trial.request not in req_ids:
                return None
            row = list(req_ids).index(trial.request)
            caught_up = behind is None or behind[row] <= 1
            self.request_depths = np.zeros(reqs, dtype=np.int64)
            self.request_depths[row] = trial.cut.depth
        if not caught_up:
            self._trial = trial
        self.decisions += 1
        return trial.cut

    def _kept(self, kept: KeptChoice | None, key: tuple, exploring: bool) -> Cut | None:
        """``kept``'s cut (and its requests' depths, as this decision's) if it holds for
        ``key`` at this decision and no trial is affordable, else None."""
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


def per_request_total(tokens: np.ndarray, depths: np.ndarray | None, depth: int) -> float:
    """Expected tokens of a step whose requests (``tokens`` [R, D+1]) are cut to
    ``depths`` [R] (None: all to ``depth``)."""
    if depths is None:
        return float(tokens[:, depth].sum())
    return float(tokens[np.arange(len(tokens)), depths].sum())


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
