"""tree auto in a simulated engine (``sizing.simulation``): a machine's step costs
and the requests' acceptance as seeded random draws, no model weights. What the
choice must do at any load: never cost more than 2 % against no speculation
where speculating never pays, reach 95 % of the best fixed cut where it does,
change regime within a bounded number of steps when the load moves, stay locked
in neither regime by a slow spell, and stall no stream (the gap between a
stream's tokens: p99 at most 1.5x no speculation's)."""

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
# In between: trees pay for one request and not for eight.
MIXED = Machine(affine(0.1, 0.01), affine(0.02, 0.004), per_tree_row=0.001, per_speculating_step=0.005)


def auto(machine, seed):
    return Auto(machine, SHAPES, np.random.default_rng(seed))


def constant(c):
    return lambda step: c


@pytest.mark.quick
@pytest.mark.parametrize("machine,concurrency", [(NEVER_PAYS, 1), (NEVER_PAYS, 4), (NEVER_PAYS, 16), (MIXED, 8), (MIXED, 16)])
def test_where_speculating_never_pays_auto_costs_at_most_two_percent(machine, concurrency):
    for seed in SEEDS:
        plain = simulate(machine, FixedCut(0, 0), SHAPES, constant(concurrency), STEPS, seed)
        chosen = simulate(machine, auto(machine, seed), SHAPES, constant(concurrency), STEPS, seed)
        assert chosen.rate >= plain.rate / 1.02, (seed, chosen.rate / plain.rate)
        assert chosen.gap_quantile() <= 1.5 * plain.gap_quantile(), seed


@pytest.mark.quick
@pytest.mark.parametrize("machine,concurrency", [(PAYS, 1), (PAYS, 8), (PAYS, 16), (MIXED, 1)])
def test_where_speculating_pays_auto_reaches_the_best_fixed_cut(machine, concurrency):
    for seed in SEEDS:
        plain = simulate(machine, FixedCut(0, 0), SHAPES, constant(concurrency), STEPS, seed)
        fixed = [
            simulate(machine, FixedCut(s, d), SHAPES, constant(concurrency), STEPS, seed)
            for s in range(len(SHAPES))
            for d in range(1, len(SHAPES[s]))
        ]
        best = max(fixed, key=lambda run: run.rate)
        assert best.rate > 1.1 * plain.rate  # the case is one where trees pay
        chosen = simulate(machine, auto(machine, seed), SHAPES, constant(concurrency), STEPS, seed)
        assert chosen.rate >= 0.95 * best.rate, (seed, chosen.rate / best.rate)
        assert chosen.gap_quantile() <= 1.5 * plain.gap_quantile(), (seed, chosen.gap_quantile() / plain.gap_quantile())


@pytest.mark.quick
def test_a_load_step_changes_the_regime_within_a_bounded_number_of_steps():
    """1 -> 16 -> 1 requests on a machine where trees pay for one request only."""
    settle = 40
    load = lambda step: 16 if 300 <= step < 600 else 1  # noqa: E731
    for seed in SEEDS:
        run = simulate(MIXED, auto(MIXED, seed), SHAPES, load, 900, seed)
        assert run.speculating_share(settle, 300) >= 0.7, seed
        assert run.speculating_share(300 + settle, 600) <= 0.02, seed
        assert run.speculating_share(600 + settle, 900) >= 0.7, seed


@pytest.mark.quick
@pytest.mark.parametrize("speculating_only", [True, False], ids=["speculating-steps", "every-step"])
def test_a_slow_spell_locks_neither_regime(speculating_only):
    """Steps 3x slower for a while (only the speculating ones, or all): once it is
    over, one request speculates again, sixteen stay plain."""
    for concurrency, regime in ((1, 0.7), (16, 0.02)):
        for seed in SEEDS:
            machine = Machine(**{**MIXED.__dict__, "slow": 3.0, "slow_steps": (50, 250), "slow_speculating_only": speculating_only})
            run = simulate(machine, auto(machine, seed), SHAPES, constant(concurrency), 500, seed)
            share = run.speculating_share(300, 500)
            assert (share >= regime) if concurrency == 1 else (share <= regime), (concurrency, seed, share)
