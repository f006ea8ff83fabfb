"""The draft's catch-up, bounded per step like a chunked prefill.

A request that has not speculated for a while (a new prompt, plain steps) has
tokens whose draft KV is missing: the drafter's level 0 must run them before it
can root a tree. Run at once, a 2000-token prompt's draft prefill stalls every
stream of the batch for that step. Instead each step runs at most a budget of
them over its requests, the least behind first (``split_catch_up``); the first
that does not fit runs what fits as a chunk and drafts no tree, and the ones
after it wait. The budget is a share of the step's time (``catch_up_budget``).
"""

from __future__ import annotations

import numpy as np

# A step's catch-up runs in at most this share of the step's time without it: a step
# where requests start speculating takes at most 1.5x its own time, instead of
# stalling every stream behind a prompt's draft prefill (``benchmarks/serving.py``: ITL
# p99 4-5x plain's before; ``tests/sizing/test_simulated_engine.py``: 0.25 gave up 5-7 %
# of throughput at 16 requests where trees pay, requests waiting to catch up).
CATCH_UP_SHARE = 0.5
# The fewest catch-up tokens a step runs: a request behind gains ground every step
# (a plain step adds one token).
MIN_CATCH_UP_TOKENS = 2
BUDGET_GRID = np.array(
    [2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192]
)


def split_catch_up(behind: np.ndarray, budget: int) -> tuple[np.ndarray, int, int]:
    """(fits [R] bool, row, chunk) for requests ``behind`` [R] tokens under ``budget``
    tokens for the step, the least behind first (as many requests draft as can; one
    that is not behind always does): the requests that catch up in full and draft;
    ``row`` the first in that order that does not fit (-1: all fit), which runs
    ``chunk`` (>= 0) of its tokens and no tree; the others wait."""
    order = np.argsort(behind, kind="stable")
    spent = np.cumsum(behind[order])
    fits = np.empty(len(behind), dtype=bool)
    fits[order] = spent <= budget
    if fits.all():
        return fits, -1, 0
    first = int(np.argmin(spent <= budget))
    return fits, int(order[first]), budget - int(spent[first - 1] if first else 0)


def catch_up_budget(cost, num_requests: int, target_tokens: int, share: float = CATCH_UP_SHARE) -> int:
    """Tokens a step of ``num_requests`` whose target ran ``target_tokens`` may catch
    up: the most of ``BUDGET_GRID`` whose draft time (what they add to a level-0
    forward over the roots, by ``cost``, a ``StepCostModel``) stays within ``share``
    of the step's own time without them (a plain decode step's, or the target's
    forward over a prefill's tokens where that is longer: a prompt's catch-up rides
    in the step that prefills it, as a draft model's prefill does in vLLM); at least
    ``MIN_CATCH_UP_TOKENS``. (A chunk's forward of its own adds the draft's fixed
    cost of a forward once.)"""
    step = max(cost.seconds(num_requests, 0), cost.target(target_tokens) * cost.factor(0, num_requests))
    extra = cost.draft.many(num_requests + BUDGET_GRID) - cost.draft(num_requests)
    fits = int(np.searchsorted(extra, share * step, side="right"))
    return int(BUDGET_GRID[fits - 1]) if fits else MIN_CATCH_UP_TOKENS
