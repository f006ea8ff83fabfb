"""tree auto in a simulated engine (``sizing.simulation``): a machine's step costs
and the requests' acceptance as seeded random draws, no model weights. What the
choice must do at any load: never cost more than 2 % against no speculation
where speculating never pays, reach 95 % of the best fixed cut where it does,
change regime within a bounded number of steps when the load moves, stay locked
in neither regime by a slow spell, and stall no stream (the gap between a
stream's tokens: where it does not speculate, p99 at most 1.5x no speculation's; where it
does, no step 1.5x longer for the draft's catch-up in it, p99)."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_univer.sizing.simulation import Auto, FixedCut, Machine, affine, simulate

CHAIN = [1, 1, 1, 1, 1, 1]
TREE = [1, 2, 2, 2, 2, 2]  # 2x5's width cut per depth: two children per node... as nodes per depth of a chain of pairs
SHAPES = [CHAIN, TREE]
STEPS = 400
SEEDS = (0, 1, 2)

# A compute-bound machine (a CPU serving a model much larger than its draft): a forward
# costs in proportion to its tokens, so no tree ever pays.
NEVER_PAYS = Machine(affine(0.05, 0.045), affine(0.02, 0.015), per_tree_row=0.004, per_speculating_step=0.01)
# A memory-bound one (a GPU at these batch sizes): rows are nearly free, trees pay at every batch size.
PAYS = Machine(affine(0.007, 2e-5), affine(0.0015, 1e-5), per_tree_row=1e-5, per_speculating_step=3e-4)
# In between, CPU-like: trees pay for one request and not for eight; the draft's catch-up
# costs 3.6 % of a plain step per token, more than exploration's share.
MIXED = Machine(affine(0.1, 0.01), affine(0.02, 0.004), per_tree_row=0.001, per_speculating_step=0.005)
# In between, GPU-like: trees pay 1.4x for one request and not at all for sixteen; the
# draft's catch-up costs 0.2 % of a plain step per token.
MIXED_GPU = Machine(affine(0.010, 5e-4), affine(0.002, 2e-5), per_tree_row=2e-4, per_speculating_step=5e-4)


def auto(machine, seed):
    return Auto(machine, SHAPES, np.random.default_rng(seed))


def constant(c):
    return lambda step: c


@pytest.mark.quick
@pytest.mark.parametrize(
    "machine,concurrency",
    [(NEVER_PAYS, 1), (NEVER_PAYS, 4), (NEVER_PAYS, 16), (MIXED, 8), (MIXED, 16), (MIXED_GPU, 16)],
    ids=["never-1", "never-4", "never-16", "mixed-8", "mixed-16", "mixed_gpu-16"],
)
def test_where_speculating_never_pays_auto_costs_at_most_two_percent(machine, concurrency):
    for seed in SEEDS:
        plain = simulate(machine, FixedCut(0, 0), SHAPES, constant(concurrency), STEPS, seed)
        chosen = simulate(machine, auto(machine, seed), SHAPES, constant(concurrency), STEPS, seed)
        assert chosen.rate >= plain.rate / 1.02, (seed, chosen.rate / plain.rate)
        assert chosen.gap_quantile() <= 1.5 * plain.gap_quantile(), seed


@pytest.mark.quick
@pytest.mark.parametrize(
    "machine,concurrency",
    [(PAYS, 1), (PAYS, 8), (PAYS, 16), (MIXED, 1), (MIXED_GPU, 1)],
    ids=["pays-1", "pays-8", "pays-16", "mixed-1", "mixed_gpu-1"],
)
def test_where_speculating_pays_auto_reaches_the_best_fixed_cut(machine, concurrency):
    steps = 4 * STEPS if concurrency < 4 else STEPS  # a few requests' worth at least
    for seed in SEEDS:
        plain = simulate(machine, FixedCut(0, 0), SHAPES, constant(concurrency), steps, seed)
        fixed = [
            simulate(machine, FixedCut(s, d), SHAPES, constant(concurrency), steps, seed)
            for s in range(len(SHAPES))
            for d in range(1, len(SHAPES[s]))
        ]
        best = max(fixed, key=lambda run: run.rate)
        assert best.rate > 1.1 * plain.rate  # the case is one where trees pay
        chosen = simulate(machine, auto(machine, seed), SHAPES, constant(concurrency), steps, seed)
        assert chosen.rate >= 0.95 * best.rate, (seed, chosen.rate / best.rate)
        # No step stalls the batch: the draft's catch-up makes no stream wait 1.5x longer.
        assert chosen.stall_quantile() <= 1.5, (seed, chosen.stall_quantile())
        assert chosen.stall_quantile(1.0) <= 2.0, (seed, chosen.stall_quantile(1.0))


@pytest.mark.quick
def test_a_load_step_changes_the_regime_within_a_bounded_number_of_steps():
    """1 -> 16 -> 1 requests on a machine where trees pay for one request only: the
    regime follows within 50 steps."""
    settle = 50
    load = lambda step: 16 if 300 <= step < 600 else 1  # noqa: E731
    for seed in SEEDS:
        run = simulate(MIXED_GPU, auto(MIXED_GPU, seed), SHAPES, load, 900, seed)
        assert run.speculating_share(settle, 300) >= 0.8, seed
        assert run.speculating_share(300 + settle, 600) <= 0.02, seed
        assert run.speculating_share(600 + settle, 900) >= 0.8, seed


@pytest.mark.quick
@pytest.mark.parametrize("speculating_only", [True, False], ids=["speculating-steps", "every-step"])
def test_a_slow_spell_locks_neither_regime(speculating_only):
    """Steps 3x slower for 200 steps (only the speculating ones, or all): within 100
    steps of its end one request speculates again, and sixteen stay plain. (Where
    the draft's catch-up of a token costs more than exploration's share of a step,
    as on the CPU-like machine, a request the draft fell behind on is not tried again
    before the next one comes: the allowance grows slower than its catch-up.)"""
    spell = {"slow": 3.0, "slow_steps": (50, 250), "slow_speculating_only": speculating_only}
    machine = Machine(**{**MIXED_GPU.__dict__, **spell})
    for seed in SEEDS:
        alone = simulate(machine, auto(machine, seed), SHAPES, constant(1), 600, seed)
        assert alone.speculating_share(350, 600) >= 0.8, (seed, alone.speculating_share(350, 600))
        busy = simulate(machine, auto(machine, seed), SHAPES, constant(16), 600, seed)
        assert busy.speculating_share(300, 600) <= 0.02, (seed, busy.speculating_share(300, 600))
