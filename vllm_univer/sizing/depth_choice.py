"""The depth cut of the tree that maximises tokens per second for the batch at hand.

Candidates are the depth cuts 0 .. D of the configured tree (0: no speculation,
a plain decode step: no draft forward, one target row per request). All
requests of a step share the cut. The choice is

    argmax_d  sum_r E[tokens_r | d] / seconds(R, d),

with a little exploration: every ``explore_every`` decisions the next deeper cut
is tried, so the acceptance and cost estimates of cuts that are not chosen stay
current; but never a cut that could not beat the chosen one even if every
draft were accepted, so where drafting cannot pay (a compute-bound CPU) no
step ever speculates.
"""

from __future__ import annotations

import numpy as np

from .acceptance_model import AcceptanceModel
from .cost_model import StepCostModel


def candidate_depths(max_depth: int) -> list[int]:
    return list(range(max_depth + 1))


class DepthChooser:
    def __init__(self, cost: StepCostModel, acceptance: AcceptanceModel, explore_every: int = 16):
        self.cost = cost
        self.acceptance = acceptance
        self.explore_every = explore_every
        self.decisions = 0

    def rates(self, bands) -> np.ndarray:
        """[D+1]: expected tokens per second of the batch at every depth cut."""
        reqs = len(bands)
        tokens = self.acceptance.expected_tokens(bands).sum(0)
        seconds = np.array([self.cost.seconds(reqs, d) for d in range(len(tokens))])
        return tokens / seconds

    def choose(self, bands) -> int:
        """The depth cut for a step whose requests are in temperature ``bands``."""
        reqs = len(bands)
        if reqs == 0:
            return 0
        rates = self.rates(bands)
        best = int(np.argmax(rates))
        self.decisions += 1
        deeper = best + 1
        if self.explore_every and self.decisions % self.explore_every == 0 and deeper < len(rates):
            # Every draft accepted: deeper + 1 tokens per request.
            ceiling = reqs * (deeper + 1) / self.cost.seconds(reqs, deeper)
            if ceiling > rates[best]:
                best = deeper
        return best
