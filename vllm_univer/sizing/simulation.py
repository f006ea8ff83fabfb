"""A simulated engine for ``"tree": "auto"``: a machine's step costs and the
requests' acceptance as random draws, no model weights, seeded.

It runs what the runner runs around the choice (``integration.tree_sizer``):
every step the batch's requests, their temperature bands, the draft's backlog
and the tokens they have left go to ``TreeChooser.choose``; the step's forwards
(``StepCostModel.mixed_work``, the draft's catch-up at level 0) are timed on the
simulated machine; the cost models learn from the period and the acceptance
models from the verified trees, as ``TreeSizer`` has them learn. The same
requests run under any policy (the choice, a fixed cut, no speculation), so
their times compare like two engines serving the same load.

The machine is what the choice cannot see: the forwards' true time (the choice
knows it only through a start-up calibration with noise and the corrections it
learns), the speculating steps' overheads beyond the forwards (verification,
tree attention: per tree row), slow spells (every step slower for a while), and
the requests' true per-child acceptance. ``tests/sizing/test_simulated_engine.py``
states what the choice must do on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .acceptance_model import AcceptanceModel, children_per_node, prior_hazards
from .catch_up import catch_up_budget, split_catch_up
from .cost_model import ForwardCost, StepCostModel, StepWork
from .tree_choice import ShapeModels, TreeChooser

CALIBRATION_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
# The scheduler's tokens per step (vLLM's max_num_batched_tokens): a fixed cut's catch-up budget.
STEP_TOKEN_BUDGET = 2048


@dataclass
class Machine:
    """True step costs. ``target(n)`` / ``draft(n)``: seconds of a forward over n
    query tokens; a speculating step adds ``per_speculating_step`` and
    ``per_tree_row`` for each target row beyond one per request; every step's
    time is multiplied by a lognormal draw of spread ``noise``, and by ``slow``
    (factor) during the steps in ``slow_steps`` (start, stop): every step's, or
    ``slow_speculating_only`` the speculating steps'."""

    target: Callable[[float], float]
    draft: Callable[[float], float]
    per_tree_row: float = 0.0
    per_speculating_step: float = 0.0
    noise: float = 0.03
    slow: float = 1.0
    slow_steps: tuple[int, int] = (0, 0)
    slow_speculating_only: bool = False

    def seconds(self, work: StepWork, num_requests: int, step: int, noise: float) -> float:
        """Seconds of ``work`` at step ``step``, ``noise`` a standard normal draw."""
        tree_rows = work.target_tokens - num_requests
        out = self.target(work.target_tokens) + sum(self.draft(n) for n in work.draft_tokens)
        if tree_rows > 0:
            out += self.per_speculating_step + self.per_tree_row * tree_rows
        if self.slow_steps[0] <= step < self.slow_steps[1] and (tree_rows > 0 or not self.slow_speculating_only):
            out *= self.slow
        return out * float(np.exp(self.noise * noise))


def affine(fixed: float, per_token: float) -> Callable[[float], float]:
    """A forward's seconds: ``fixed`` + ``per_token`` x query tokens."""
    return lambda n: fixed + per_token * n


@dataclass
class Request:
    """One simulated request: its prompt (what the draft must first run), its
    output length, its temperature band and true per-child acceptance."""

    name: str
    prompt: int
    max_tokens: int
    band: int
    acceptance: float
    generated: int = 0
    draft_seen: int = 0  # tokens of its context whose draft KV exists
    # Its acceptance draws (seeded with it: the same draws under every policy, so that
    # two policies' runs differ by their choices, not by luck).
    draws: np.random.Generator | None = None

    @property
    def committed(self) -> int:
        return self.prompt + self.generated


def request_stream(seed: int, prompt=(64, 512), max_tokens=(64, 256), acceptance=(0.55, 0.85), bands=(2,)):
    """Requests drawn one after another from ``seed``: the same stream for every policy."""
    rng = np.random.default_rng(seed)
    k = 0
    while True:
        yield Request(
            name=f"r{k}",
            prompt=int(rng.integers(*prompt)),
            max_tokens=int(rng.integers(*max_tokens)),
            band=int(rng.choice(bands)),
            acceptance=float(rng.uniform(*acceptance)),
            draws=np.random.default_rng([seed, k]),
        )
        k += 1


class Policy:
    """Chooses each step's shape (index into ``shapes``) and per-request depth cuts."""

    def decide(self, requests: list[Request], unseen: np.ndarray, tokens_left: float) -> tuple[int, np.ndarray]:
        """``unseen`` [R]: tokens of each request the draft has not run."""
        raise NotImplementedError

    def catch_up_budget(self, num_requests: int, target_tokens: int) -> int:
        """Tokens of the draft's catch-up a step whose target ran ``target_tokens`` may run
        (``sizing.catch_up``)."""
        return STEP_TOKEN_BUDGET - target_tokens

    def learn(self, shape, depths, work, seconds, requests, accepted, chunk: int = 0) -> None:
        """What a step did: ``chunk`` tokens of a catch-up chunk besides (``TreeSizer``
        learns no cost from such a step)."""


class FixedCut(Policy):
    def __init__(self, shape: int, depth: int):
        self.shape, self.depth = shape, depth

    def decide(self, requests, unseen, tokens_left):
        return self.shape, np.full(len(requests), self.depth, dtype=np.int64)


class Auto(Policy):
    """``tree: auto``: a ``TreeChooser`` calibrated on the machine at start-up (the
    forwards timed with its noise) and learning as ``TreeSizer`` has it learn."""

    def __init__(self, machine: Machine, shapes: list[list[int]], rng: np.random.Generator, **chooser_args):
        def timed(fn):
            return [fn(n) * float(np.exp(machine.noise * rng.standard_normal())) for n in CALIBRATION_SIZES]

        target = ForwardCost(list(CALIBRATION_SIZES), timed(machine.target))
        draft = ForwardCost(list(CALIBRATION_SIZES), timed(machine.draft))
        self.chooser = TreeChooser(
            [
                ShapeModels(
                    StepCostModel(target, draft, widths),
                    AcceptanceModel(len(widths) - 1, prior_hazards(widths), children=children_per_node(widths)),
                )
                for widths in shapes
            ],
            **chooser_args,
        )
        self._chain = next((i for i, widths in enumerate(shapes) if max(widths) == 1), None)

    def catch_up_budget(self, num_requests, target_tokens):
        cost = self.chooser.shapes[-1].cost
        return min(catch_up_budget(cost, num_requests, target_tokens), STEP_TOKEN_BUDGET - target_tokens)

    def decide(self, requests, unseen, tokens_left):
        bands = np.array([r.band for r in requests])
        names = [r.name for r in requests]
        for _, acceptance in self.chooser.shapes:
            acceptance.forget_requests_except(set(names))
        cut = self.chooser.choose(bands, None, int(unseen.sum()), tokens_left, names, unseen)
        depths = self.chooser.request_depths
        return cut.shape, np.full(len(requests), cut.depth) if depths is None else np.asarray(depths)

    def learn(self, shape, depths, work, seconds, requests, accepted, chunk=0):
        chooser, reqs = self.chooser, len(requests)
        depth = int(depths.max(initial=0))
        if not chunk and chooser.shapes[shape].cost.is_decode_step(work, reqs, depth):
            for s, (cost, _) in enumerate(chooser.shapes):
                if s == shape or depth == 0:
                    cost.observe(depth, work, seconds, reqs)
        spec = np.nonzero(depths > 0)[0]
        if spec.size:
            bands = [requests[i].band for i in spec]
            chooser.shapes[shape].acceptance.observe(
                bands, depths[spec], accepted[spec], [requests[i].name for i in spec]
            )
            if self._chain is not None and shape != self._chain:
                # What the chain would have accepted on these trees (``TreeSizer.observe_chain``:
                # an unbiased estimate of P(A >= j) per tree; here its expectation, s^j).
                s = np.array([requests[i].acceptance for i in spec])[:, None]
                survival = s ** np.arange(1, int(depths.max()) + 1)
                chooser.shapes[self._chain].acceptance.observe_survival(bands, depths[spec], survival)


@dataclass
class Run:
    """What a simulated run did: per step its batch size, speculating requests and seconds."""

    seconds: float = 0.0
    tokens: int = 0
    steps: list[tuple[int, int, float]] = field(default_factory=list)
    # Per token a stream received after its first: the seconds it waited for it (a
    # step's time over the tokens it gave the stream; a prefill's wait is its TTFT).
    gaps: list[float] = field(default_factory=list)
    # Per stream and step: the step's time over what it would have taken without the
    # draft's catch-up in it (1: none ran).
    stalls: list[float] = field(default_factory=list)

    @property
    def rate(self) -> float:
        """Output tokens per second."""
        return self.tokens / self.seconds

    def speculating_share(self, start: int = 0, stop: int | None = None) -> float:
        """Of the request-steps in steps ``start`` .. ``stop``, those that speculated."""
        window = self.steps[start:stop]
        return sum(s for _, s, _ in window) / max(sum(b for b, _, _ in window), 1)

    def gap_quantile(self, q: float = 0.99) -> float:
        """The ``q`` quantile of the waits per token (``gaps``): a step that stalls
        the batch (a prompt's catch-up) shows, one that streams several tokens in
        twice a plain step's time does not."""
        return float(np.quantile(self.gaps, q))

    def stall_quantile(self, q: float = 0.99) -> float:
        """The ``q`` quantile of ``stalls``."""
        return float(np.quantile(self.stalls, q))


def simulate(
    machine: Machine,
    policy: Policy,
    shapes: list[list[int]],
    concurrency: Callable[[int], int],
    steps: int,
    seed: int = 0,
    stream=None,
) -> Run:
    """Serve ``steps`` steps with ``concurrency(step)`` requests in the batch, closed
    loop: a request that ends is replaced by the stream's next one, whose prompt the
    target prefills in the step it joins (its first token; the draft may catch up on
    it in that step: the drafting after a prefill). Accepted depths are drawn from
    each request's per-child acceptance s: a node with m children goes on with
    1 - (1 - s)^m."""
    rng = np.random.default_rng(seed + 1)
    stream = request_stream(seed) if stream is None else stream
    batch: list[Request] = []
    run = Run()
    children = [np.concatenate([children_per_node(w), [1.0]]) for w in shapes]
    for step in range(steps):
        want = concurrency(step)
        joined = [next(stream) for _ in range(want - len(batch))]
        prefill = sum(r.prompt for r in joined)
        batch = batch[:want] + joined
        left = np.array([r.max_tokens - r.generated for r in batch], dtype=np.float64)
        # Tokens the draft has not seen (``TreeSizer._draft_backlog``): 0 after a step that drafted.
        unseen = np.array([r.committed - r.draft_seen for r in batch], dtype=np.int64)
        shape, depths = policy.decide(batch, unseen, float(np.median(left)))
        depths = depths.copy()
        # The draft's catch-up, bounded as ``TreeDrafter._catch_up`` bounds it: level 0
        # runs the root and the token before it, and the rest of what it has not seen.
        spec = np.nonzero(depths > 0)[0]
        behind = np.maximum(unseen[spec] - 1, 0)
        fits, row, chunk = split_catch_up(behind, policy.catch_up_budget(len(batch), prefill + len(batch)))
        depths[spec[~fits]] = 0
        if chunk:
            batch[spec[row]].draft_seen += chunk
        caught_up = int(behind[fits].sum())
        for i in spec[fits]:
            batch[i].draft_seen = batch[i].committed
        new = len(batch) - len(joined)
        tree = depths[:new]  # a request that joined drafts after its prefill: its tree is verified next step
        cost = StepCostModel(ForwardCost([1], [0.0]), ForwardCost([1], [0.0]), shapes[shape])
        work = cost.mixed_work(tree.tolist())
        draft = work.draft_tokens or [0]
        draft[0] += caught_up + int((tree > 0).sum()) + 2 * int((depths[new:] > 0).sum())
        timed = StepWork(work.target_tokens + prefill, ([chunk] if chunk else []) + [n for n in draft if n])
        draft[0] -= caught_up
        without = StepWork(work.target_tokens + prefill, [n for n in draft if n])
        noise = float(rng.standard_normal())
        seconds = machine.seconds(timed, len(batch), step, noise)
        run.stalls += [seconds / machine.seconds(without, len(batch), step, noise)] * len(batch)
        depths[new:] = 0
        accepted = np.zeros(len(batch), dtype=np.int64)
        for i, r in enumerate(batch):
            d = int(depths[i])
            if d:
                go_on = 1.0 - (1.0 - r.acceptance) ** children[shape][:d]
                passed = r.draws.random(len(children[shape]))[:d] < go_on
                accepted[i] = d if passed.all() else int(np.argmin(passed))
            tokens = min(int(accepted[i]) + 1, r.max_tokens - r.generated)
            if i < new:
                run.gaps += [seconds / tokens] * tokens
            r.generated += tokens
            if d:  # the drafter ran the accepted nodes; what it has not seen is its next level 0's
                r.draft_seen = r.committed
            run.tokens += tokens
        policy.learn(shape, depths, timed, seconds, batch, accepted, chunk)
        run.seconds += seconds
        run.steps.append((len(batch), int((depths > 0).sum()), seconds))
        batch = [r for r in batch if r.generated < r.max_tokens]
    return run
