"""How many tokens a step gets per request, per depth cut of the tree, from
acceptance statistics kept while serving.

For a tree cut to depth d, a step yields 1 + A tokens, A the accepted depth.
With h_j = P(A >= j | A >= j - 1, the tree reaches depth j), the hazard of the
verifier at depth j on this tree shape,

    E[tokens | d] = 1 + sum_{k=1..d} prod_{j=1..k} h_j.

h_j is estimated from every verified tree that reached depth j (a
Kaplan-Meier estimate: a tree cut above j says nothing about h_j), with
exponential forgetting so that it follows the draft's current form, per
temperature band (greedy and sampled requests accept very differently), and
starts from a prior worth ``prior_weight`` observations.

A cut tree's node-level acceptance is not exactly the full tree's (UniVer's
stop rule at a node looks at its subtree); the estimate pools cuts, which is
what the choice needs, and the verifier stays exact whatever is drafted.

Requests of one band differ too (code accepts more than chat): each request
keeps its own decayed counts, and its hazards are its band's estimate
updated by them (``expected_tokens(bands, req_ids)``: the band's hazard worth
``REQUEST_PRIOR_WEIGHT`` observations), so that the choice can cut each
request to its own depth.

Shapes that are rarely drafted (the chain of a 2x5 while the 2x5 runs) learn
from the others before their own trials: ``share_priors`` moves each shape's
prior to what the best-observed other shape implies at the same depth and
band, through the same per-child model as ``prior_hazards`` (a node whose m
children are each accepted with probability s goes on with 1 - (1 - s)^m).
"""

from __future__ import annotations

import numpy as np

# Temperature bands: greedy, then sampled at T in (0, 0.5], (0.5, 1.0], above.
BAND_EDGES = (0.0, 0.5, 1.0)
NUM_BANDS = len(BAND_EDGES) + 1
# The prior's weight in observations never decays below this.
MIN_PRIOR_WEIGHT = 1e-6
# A request's own hazards: its band's estimate, worth this many observations, updated by its own.
REQUEST_PRIOR_WEIGHT = 8.0


def temperature_band(temperature) -> np.ndarray:
    """Band index of each request's temperature (0: greedy)."""
    t = np.asarray(temperature, dtype=np.float64)
    return np.searchsorted(np.asarray(BAND_EDGES), t, side="left")


def prior_hazards(nodes_per_depth: list[int], single: float = 0.7) -> np.ndarray:
    """[D] prior h_j of a tree shape: a path accepted to depth j - 1 goes on
    with one of its m_j children (m_j = nodes at depth j over nodes at j - 1),
    each taken as accepted with probability ``single`` on its own, so
    h_j = 1 - (1 - single)^m_j: a chain starts at ``single``, two children at
    0.91. Rough (children of one parent are not independent); observations
    replace it after a few steps, and it lets a wider shape start above a
    narrower one, as it is measured to be."""
    return 1.0 - (1.0 - single) ** children_per_node(nodes_per_depth)


def same_per_child(hazard, children, children_to):
    """The hazard of ``children_to`` children per node with the per-child
    acceptance that ``hazard`` implies for ``children``: s = 1 - (1 - h)^(1/m),
    then 1 - (1 - s)^m' (the model of ``prior_hazards``)."""
    single = 1.0 - (1.0 - np.clip(hazard, 0.0, 1.0)) ** (1.0 / children)
    return 1.0 - (1.0 - single) ** children_to


def children_per_node(nodes_per_depth: list[int]) -> np.ndarray:
    """[D]: m_j = nodes at depth j over nodes at depth j - 1."""
    widths = np.asarray(nodes_per_depth, dtype=np.float64)
    return widths[1:] / np.maximum(widths[:-1], 1.0)


class AcceptanceModel:
    def __init__(
        self, max_depth: int, prior_hazard=0.7, prior_weight: float = 4.0, memory: float = 0.995, children=None
    ):
        """``prior_hazard``: one h for every depth, or [D] (``prior_hazards``), or
        [band, D] (one prior per temperature band).
        ``children``: [D] children per node of the shape (``children_per_node``);
        given, a depth seen little starts from what the depth above it is estimated
        to be, through the per-child model (``same_per_child``), where that is above
        the shape's own prior: cuts deeper than any drafted so far are valued like
        the deepest one measured (a chain accepting 0.9 per token at depths 1-3 is not assumed to
        fall to 0.7 at depth 4). A prior borrowed from another shape
        (``share_priors``) is kept where there is one."""
        self.max_depth = max_depth
        self.children = None if children is None else np.asarray(children, dtype=np.float64)
        self.memory = memory
        # [band, depth 1..D]: decayed counts of trees that reached depth j, and of those accepted to j.
        self.reached = np.zeros((NUM_BANDS, max_depth))
        self.accepted = np.zeros((NUM_BANDS, max_depth))
        # The prior, worth ``prior_weight`` observations that decay like the others.
        self.base_prior = np.broadcast_to(np.asarray(prior_hazard, dtype=np.float64), (NUM_BANDS, max_depth)).copy()
        self.prior = self.base_prior.copy()
        self.prior_weight = np.full((NUM_BANDS, max_depth), float(prior_weight))
        self.borrowed = np.zeros((NUM_BANDS, max_depth), dtype=bool)  # where ``prior`` came from another shape
        self._hazards: np.ndarray | None = None  # cached until the counts or the prior change
        self.observations = 0  # calls that added trees
        # Each request's decayed counts, [slot, D] (reached, accepted), and its slot.
        self._slot: dict[str, int] = {}
        self._request_counts = np.zeros((2, 0, max_depth))

    def observe(self, bands, cut_depths, accepted_depths, req_ids=None) -> None:
        """Verified trees: their band, the depth they were cut to, the depth
        accepted, and (given) their request, to learn each request's own hazards."""
        cut = np.asarray(cut_depths, dtype=np.int64)[:, None]
        acc = np.asarray(accepted_depths, dtype=np.int64)[:, None]
        j = np.arange(1, self.max_depth + 1)
        # Tree t informs h_j when it reached depth j - 1 (acc >= j - 1) and had nodes at depth j (cut >= j).
        both = np.empty((2, len(cut), self.max_depth))  # [at risk, passed]
        np.logical_and(acc >= j - 1, cut >= j, out=both[0])
        np.logical_and(both[0], acc >= j, out=both[1])
        self._add(bands, both)
        if req_ids is not None and len(req_ids):
            slots = self._slots(req_ids)
            counts = self._request_counts
            if len(set(req_ids)) == len(req_ids):  # one tree per request, as verified
                counts[:, slots] = counts[:, slots] * self.memory + both
            else:
                counts[:, slots] *= self.memory
                np.add.at(counts, (slice(None), slots), both)

    def _slots(self, req_ids) -> np.ndarray:
        """The rows of ``req_ids`` in the per-request counts (new ones start at zero)."""
        slot = self._slot
        new = [r for r in dict.fromkeys(req_ids) if r not in slot]
        if new:
            free = sorted(set(range(self._request_counts.shape[1])) - set(slot.values()))
            needed = len(new) - len(free)
            if needed > 0:  # grow by doubling: rare, and the counts stay one array
                grow = max(needed, self._request_counts.shape[1])
                start = self._request_counts.shape[1]
                self._request_counts = np.concatenate([self._request_counts, np.zeros((2, grow, self.max_depth))], 1)
                free += range(start, start + grow)
            for r, i in zip(new, free):
                slot[r] = i
                self._request_counts[:, i] = 0.0
        return np.fromiter((slot[r] for r in req_ids), dtype=np.int64, count=len(req_ids))

    def forget_requests_except(self, live_req_ids) -> None:
        """Drop the counts of requests no longer served (their slots are reused)."""
        if len(self._slot) > len(live_req_ids):
            self._slot = {r: i for r, i in self._slot.items() if r in live_req_ids}

    def observe_survival(self, bands, cut_depths, survival) -> None:
        """Trees of this shape that were not drafted, through estimates of what
        they would have accepted: ``survival`` [R, D'] (D' <= D) unbiased estimates
        of P(A >= j) (``chain_estimate``), informative through ``cut_depths``. Counted
        as expected observations: at risk at j with weight S_(j-1), passed with S_j."""
        cut = np.asarray(cut_depths, dtype=np.int64)
        survival = np.asarray(survival, dtype=np.float64)[:, : self.max_depth]
        survival = np.pad(survival, ((0, 0), (0, self.max_depth - survival.shape[1])))
        before = np.concatenate([np.ones_like(survival[:, :1]), survival[:, :-1]], 1)
        informs = cut[:, None] >= np.arange(1, self.max_depth + 1)
        self._add(bands, np.stack([informs * before, informs * survival]))

    def _add(self, bands, both: np.ndarray) -> None:
        """Forget a little, then count ``both`` [2, R, D] trees at risk at each depth
        and passed, of requests in ``bands`` [R]."""
        bands = np.asarray(bands, dtype=np.int64)
        if bands.size == 0:
            return
        self.reached *= self.memory
        self.accepted *= self.memory
        # Kept above a floor: counts of a depth or band seen no more decay to 0 (0.995^n
        # underflows after some 150 000 steps of serving), and 0 / 0 would make the
        # estimate NaN; long unseen, it returns to the prior instead.
        self.prior_weight = np.maximum(self.prior_weight * self.memory, MIN_PRIOR_WEIGHT)
        per_band = (bands == np.arange(NUM_BANDS)[:, None]) @ both  # [2, band, D]: one product, no add.at
        self.reached += per_band[0]
        self.accepted += per_band[1]
        self._hazards = None
        self.observations += 1

    def set_prior(self, prior: np.ndarray, borrowed: np.ndarray) -> None:
        """[band, D] prior hazards, and where they were borrowed from another shape."""
        if not (np.array_equal(prior, self.prior) and np.array_equal(borrowed, self.borrowed)):
            self.prior, self.borrowed, self._hazards = prior, borrowed, None

    def hazards(self) -> np.ndarray:
        """[band, D] estimates of h_j (do not modify: cached)."""
        if self._hazards is None:
            weight = self.prior_weight
            out = (self.accepted + weight * self.prior) / (self.reached + weight)
            if self.children is not None and self.max_depth > 1:
                out = np.array(self._follow_above(out.tolist()))
            self._hazards = out
        return self._hazards

    def _follow_above(self, out: list[list[float]]) -> list[list[float]]:
        """``out`` [band][D] with each depth's prior (where not borrowed) following the
        estimate of the depth above, in order of depth. Python floats: a recurrence over
        a few depths and bands, where NumPy's per-call overhead would be most of the time."""
        accepted, reached, weight = self.accepted.tolist(), self.reached.tolist(), self.prior_weight.tolist()
        prior, base, borrowed = self.prior.tolist(), self.base_prior.tolist(), self.borrowed.tolist()
        children = self.children.tolist()
        for b, row in enumerate(out):
            for j in range(1, self.max_depth):
                above, m_above, m = row[j - 1], children[j - 1], children[j]
                if m != m_above:  # same width: same h (``same_per_child`` on floats)
                    single = 1.0 - (1.0 - min(max(above, 0.0), 1.0)) ** (1.0 / m_above)
                    above = 1.0 - (1.0 - single) ** m
                # Never below the shape's own prior: optimistic for what is unseen, so
                # that a low estimate above does not keep deeper cuts from being tried.
                p = prior[b][j] if borrowed[b][j] else max(above, base[b][j])
                row[j] = (accepted[b][j] + weight[b][j] * p) / (reached[b][j] + weight[b][j])
        return out

    def expected_tokens(self, bands, req_ids=None) -> np.ndarray:
        """[R, D+1]: E[tokens per step] of each request at every depth cut 0..D:
        its band's, or (``req_ids`` given) its own (the band's updated by what
        the request's own trees accepted)."""
        bands = np.asarray(bands, dtype=np.int64)
        hazards = self.hazards()[bands]  # [R, D]
        if req_ids is not None and self._slot:
            seen = [self._slot.get(r, -1) for r in req_ids]
            if max(seen) >= 0:
                rows = np.asarray(seen)
                reached, accepted = self._request_counts[:, rows] * (rows >= 0)[None, :, None]
                hazards = (accepted + REQUEST_PRIOR_WEIGHT * hazards) / (reached + REQUEST_PRIOR_WEIGHT)
        survival = np.cumprod(hazards, axis=1)  # [R, D]: P(A >= k)
        return 1.0 + np.concatenate([np.zeros((len(bands), 1)), np.cumsum(survival, axis=1)], axis=1)


def share_priors(models: list[AcceptanceModel], children: list[np.ndarray], min_evidence: float = 2.0) -> None:
    """Set each model's prior, per band and depth, from the other model with the
    most observations there (at least ``min_evidence``; else its own
    ``base_prior``): that model's hazard h with m children per node is taken as
    per-child acceptance s = 1 - (1 - h)^(1/m), and gives this model, with m'
    children, 1 - (1 - s)^m'. ``children[i]``: [D_i] children per node of model i
    (``children_per_node``). Depths a model has and the others do not keep its base prior."""
    for i, model in enumerate(models):
        depth = model.max_depth
        best = np.zeros((NUM_BANDS, depth))
        prior = model.base_prior.copy()
        for k, other in enumerate(models):
            if k == i:
                continue
            d = min(depth, other.max_depth)
            evidence = other.reached[:, :d]
            better = (evidence >= min_evidence) & (evidence > best[:, :d])
            implied = same_per_child(other.hazards()[:, :d], children[k][:d], children[i][:d])
            prior[:, :d] = np.where(better, implied, prior[:, :d])
            best[:, :d] = np.where(better, evidence, best[:, :d])
        model.set_prior(prior, best > 0)
