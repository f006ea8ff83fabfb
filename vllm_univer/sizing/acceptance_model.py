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
"""

from __future__ import annotations

import numpy as np

# Temperature bands: greedy, then sampled at T in (0, 0.5], (0.5, 1.0], above.
BAND_EDGES = (0.0, 0.5, 1.0)
NUM_BANDS = len(BAND_EDGES) + 1


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
    widths = np.asarray(nodes_per_depth, dtype=np.float64)
    children = widths[1:] / np.maximum(widths[:-1], 1.0)
    return 1.0 - (1.0 - single) ** children


class AcceptanceModel:
    def __init__(self, max_depth: int, prior_hazard=0.7, prior_weight: float = 4.0, memory: float = 0.995):
        """``prior_hazard``: one h for every depth, or [D] (``prior_hazards``)."""
        self.max_depth = max_depth
        self.memory = memory
        # [band, depth 1..D]: decayed counts of trees that reached depth j, and of those accepted to j.
        self.reached = np.full((NUM_BANDS, max_depth), prior_weight)
        self.accepted = self.reached * np.broadcast_to(np.asarray(prior_hazard, dtype=np.float64), (max_depth,))

    def observe(self, bands, cut_depths, accepted_depths) -> None:
        """Verified trees: their band, the depth they were cut to, the depth accepted."""
        bands = np.asarray(bands, dtype=np.int64)
        cut = np.asarray(cut_depths, dtype=np.int64)
        acc = np.asarray(accepted_depths, dtype=np.int64)
        if bands.size == 0:
            return
        j = np.arange(1, self.max_depth + 1)
        # Tree t informs h_j when it reached depth j - 1 (acc >= j - 1) and had nodes at depth j (cut >= j).
        at_risk = (acc[:, None] >= j - 1) & (cut[:, None] >= j)
        passed = at_risk & (acc[:, None] >= j)
        self.reached *= self.memory
        self.accepted *= self.memory
        np.add.at(self.reached, bands, at_risk.astype(np.float64))
        np.add.at(self.accepted, bands, passed.astype(np.float64))

    def hazards(self) -> np.ndarray:
        """[band, D] estimates of h_j."""
        return self.accepted / self.reached

    def expected_tokens(self, bands) -> np.ndarray:
        """[R, D+1]: E[tokens per step] of each request at every depth cut 0..D."""
        bands = np.asarray(bands, dtype=np.int64)
        survival = np.cumprod(self.hazards(), axis=1)  # [band, D]: P(A >= k)
        per_band = 1.0 + np.concatenate([np.zeros((NUM_BANDS, 1)), np.cumsum(survival, axis=1)], axis=1)
        return per_band[bands]
