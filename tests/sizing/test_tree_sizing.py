"""``tree: auto``'s models and choice (``vllm_univer.sizing``) on fake
measurements: no vLLM, no timing."""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest

from vllm_univer.core.tree import TreeSpec
from vllm_univer.sizing import (
    AcceptanceModel,
    Cut,
    ForwardCost,
    ShapeModels,
    StepCostModel,
    StepWork,
    TreeChooser,
    acceptance_model,
    prior_hazards,
    temperature_band,
    tree_choice,
)
from vllm_univer.sizing.cost_model import DepthMixes
from vllm_univer.sizing.tree_choice import SPECULATION_MARGIN

WIDTHS_2X3 = [1, 2, 4, 8]  # nodes per depth of "2x3"


def test_nodes_per_depth():
    assert TreeSpec.parse("2x3").nodes_per_depth == WIDTHS_2X3
    assert TreeSpec.parse([[0], [1], [0, 0]]).nodes_per_depth == [1, 2, 1]


def test_forward_cost_interpolates_and_extends_the_last_slope():
    cost = ForwardCost([1, 4, 16], [1.0, 2.0, 5.0])
    assert cost(1) == 1.0 and cost(4) == 2.0
    assert cost(10) == pytest.approx(3.5)
    assert cost(28) == pytest.approx(8.0)  # slope 0.25 per token past 16
    # Noise never makes more tokens cheaper.
    assert ForwardCost([1, 2, 4], [1.0, 0.8, 2.0])(2) == 1.0


def test_step_work_counts_target_rows_and_draft_forwards():
    model = StepCostModel(ForwardCost([1, 1000], [0.0, 1.0]), ForwardCost([1, 1000], [0.0, 0.5]), WIDTHS_2X3)
    assert model.work(4, 0) == StepWork(target_tokens=4, draft_tokens=[])
    assert model.work(4, 2) == StepWork(target_tokens=4 * 7, draft_tokens=[4, 8])
    assert model.work(3, 3) == StepWork(target_tokens=3 * 15, draft_tokens=[3, 6, 12])


def test_cost_correction_is_the_median_of_recent_steps_per_depth():
    flat = ForwardCost([1, 100], [1.0, 1.0])
    model = StepCostModel(flat, flat, WIDTHS_2X3, window=5)
    assert model.seconds(1, 0) == 1.0 and model.seconds(1, 2) == 3.0
    model.observe(0, model.work(1, 0), 2.0)
    assert model.seconds(1, 0) == pytest.approx(2.0)
    assert model.seconds(1, 2) == pytest.approx(6.0)  # unseen depth, no speculating one seen: the plain correction
    for seconds in (3.0, 3.3, 2.7):
        model.observe(2, model.work(1, 2), seconds)
    assert model.seconds(1, 2) == pytest.approx(3.0)
    model.observe(2, model.work(1, 2), 300.0)  # one stall moves nothing
    assert model.seconds(1, 2) == pytest.approx(3.15)
    for _ in range(3):  # a lasting change is followed within half the window
        model.observe(2, model.work(1, 2), 12.0)
    assert model.seconds(1, 2) == pytest.approx(12.0)
    assert model.correction.tolist() == pytest.approx([2.0, 1.0, 4.0, 1.0])


def test_temperature_bands():
    assert temperature_band([0.0, 0.2, 0.5, 0.7, 1.0, 1.3]).tolist() == [0, 1, 1, 2, 2, 3]


def test_expected_tokens_compose_hazards_along_the_depth():
    model = AcceptanceModel(3, prior_weight=1e-9)
    # Band 2: every tree cut to depth 3; accepted depths 0, 1, 2, 3 in the ratio 1 : 1 : 1 : 1.
    model.observe([2] * 4, [3] * 4, [0, 1, 2, 3])
    h = model.hazards()[2]
    assert h == pytest.approx([3 / 4, 2 / 3, 1 / 2], rel=1e-6)
    expected = model.expected_tokens([2])[0]
    survival = np.cumprod(h)
    assert expected == pytest.approx([1, 1 + survival[0], 1 + survival[:2].sum(), 1 + survival.sum()])
    assert expected[3] == pytest.approx(1 + (0 + 1 + 2 + 3) / 4, rel=1e-6)  # E[1 + A] of the sample


def test_trees_cut_above_a_depth_say_nothing_about_it():
    model = AcceptanceModel(3, prior_hazard=0.5, prior_weight=2.0, memory=1.0)
    # Ten trees cut to depth 1, all accepted to the cut: evidence for h_1 only.
    model.observe([0] * 10, [1] * 10, [1] * 10)
    h = model.hazards()[0]
    assert h[0] == pytest.approx((1 + 10) / (2 + 10))
    assert h[1:] == pytest.approx([0.5, 0.5])
    # Other bands untouched.
    assert model.hazards()[1] == pytest.approx([0.5, 0.5, 0.5])


def test_forgetting_follows_a_change_in_acceptance():
    model = AcceptanceModel(1, prior_weight=1.0, memory=0.9)
    for _ in range(100):
        model.observe([1], [1], [1])
    for _ in range(100):
        model.observe([1], [1], [0])
    assert model.hazards()[1, 0] < 0.01


def margin_argmax(rates) -> int:
    """The depth a chooser commits to: the best speculating cut if it beats no
    speculation (depth 0) by ``SPECULATION_MARGIN``, else 0."""
    best = int(np.argmax(rates[1:])) + 1
    return best if rates[best] > rates[0] * (1 + SPECULATION_MARGIN) else 0


def chooser_with(target_per_token, target_fixed, draft_per_forward, hazard, widths=WIDTHS_2X3, explore=0):
    target = ForwardCost([1, 10_000], [target_fixed + target_per_token, target_fixed + 10_000 * target_per_token])
    draft = ForwardCost([1, 10_000], [draft_per_forward, draft_per_forward])
    acceptance = AcceptanceModel(len(widths) - 1, prior_hazard=hazard, prior_weight=1.0)
    # Every decision priced afresh: these tests change the estimates between two decisions.
    return TreeChooser(
        [ShapeModels(StepCostModel(target, draft, widths), acceptance)], explore_share=explore, reprice_every=1
    )


def test_choice_is_no_speculation_when_drafting_cannot_pay():
    # Compute-bound target (every row costs as much as the fixed part) and a draft as big as the target.
    chooser = chooser_with(target_per_token=1.0, target_fixed=0.0, draft_per_forward=1.0, hazard=0.9, explore=1.0)
    assert [chooser.choose([2, 2]).depth for _ in range(20)] == [
        0
    ] * 20  # exploration never tries a cut that cannot pay


def make_trial_due(chooser: TreeChooser) -> None:
    """The allowance covers the next trial: the next decision prices afresh."""
    chooser.allowance, chooser._trial_loss = 1e9, 0.0


def test_a_clear_no_speculation_is_kept_without_pricing(monkeypatch):
    """Drafting far from paying: the cuts are priced once, then no speculation is kept
    for SETTLED_DECISIONS decisions without pricing anything (a plain step must cost
    what a plain engine's does); a new temperature band in the batch, a model that
    learns from a speculating step, or a trial the allowance covers prices them again at once."""
    chooser = chooser_with(target_per_token=1.0, target_fixed=0.0, draft_per_forward=1.0, hazard=0.9, explore=0.02)
    priced = []
    rates = chooser._rates
    monkeypatch.setattr(chooser, "_rates", lambda *args: priced.append(chooser.decisions) or rates(*args))
    assert [chooser.choose([2, 2]).depth for _ in range(20)] == [0] * 20
    assert priced == [0, 1 + tree_choice.SETTLED_DECISIONS, 2 + 2 * tree_choice.SETTLED_DECISIONS]
    priced.clear()
    chooser.choose([0, 2])  # a greedy request joins
    chooser.shapes[0].acceptance.observe([2], [1], [0])
    chooser.choose([0, 2])
    chooser.shapes[0].cost.observe(0, chooser.shapes[0].cost.work(2, 0), 2.0, 2)  # plain periods: not evidence
    chooser.choose([0, 2])
    assert len(priced) == 2, priced
    make_trial_due(chooser)
    chooser.choose([0, 2])
    assert len(priced) == 3, priced


def test_a_priced_choice_is_kept_for_the_same_batch(monkeypatch):
    """Pricing every cut and mix of depths again costs some 0.3-0.5 ms of host time a
    step: a priced choice, its requests' depths with it, is kept for the next
    REPRICE_EVERY - 1 decisions of the same batch. Other requests, a catch-up to run,
    other allowed shapes or a trial the allowance covers price afresh at once; so does a model
    learning from a speculating step while no speculation is kept."""
    every = tree_choice.REPRICE_EVERY
    chooser = chooser_with(target_per_token=0.01, target_fixed=1.0, draft_per_forward=1e-3, hazard=0.8)
    chooser.reprice_every = every
    acceptance = chooser.shapes[0].acceptance
    for _ in range(100):
        acceptance.observe([2, 0], [3, 3], [3, 3], ["x", "y"])
    for _ in range(50):  # request c's drafts are never kept: no tree for it
        acceptance.observe([2], [3], [0], ["c"])
    priced = []
    rates = chooser._rates
    monkeypatch.setattr(chooser, "_rates", lambda *args: priced.append(chooser.decisions) or rates(*args))
    ids = ["a", "b", "c"]
    for _ in range(3 * every):
        assert chooser.choose([0, 2, 2], req_ids=ids) == Cut(0, 3)
        assert chooser.request_depths.tolist() == [3, 3, 0]
        acceptance.observe([0, 2], [3, 3], [3, 3], ["a", "b"])  # evidence every step: kept all the same
    assert priced == [0, every, 2 * every]
    for changed in (
        dict(req_ids=["a", "b", "d"]),  # another request
        dict(req_ids=["a", "b", "d"], backlog=12),  # a catch-up to run
        dict(req_ids=["a", "b", "d"], allowed={0}),
    ):
        priced.clear()
        chooser.choose([0, 2, 2], **changed)
        assert priced == [chooser.decisions - 1], changed
    make_trial_due(chooser)
    chooser.choose([0, 2, 2], req_ids=["a", "b", "d"], allowed={0})
    assert priced[-1] == chooser.decisions - 1

    # No speculation (not clear enough to be settled) is kept too, until a model learns
    # from a speculating step.
    monkeypatch.setattr(tree_choice, "SETTLED_BELOW", 0.0)
    plain = chooser_with(target_per_token=1.0, target_fixed=0.0, draft_per_forward=1.0, hazard=0.9)
    plain.reprice_every = every
    priced.clear()
    rates_plain = plain._rates
    monkeypatch.setattr(plain, "_rates", lambda *args: priced.append(plain.decisions) or rates_plain(*args))
    assert [plain.choose([2, 2], req_ids=["a", "b"]).depth for _ in range(every + 1)] == [0] * (every + 1)
    assert priced == [0, every]
    plain.shapes[0].acceptance.observe([2], [1], [0])
    plain.choose([2, 2], req_ids=["a", "b"])
    assert priced == [0, every, every + 1]


def test_choice_is_the_full_tree_when_rows_and_drafts_are_nearly_free():
    chooser = chooser_with(target_per_token=1e-6, target_fixed=1.0, draft_per_forward=1e-3, hazard=0.8)
    assert chooser.choose([2] * 8).depth == 3


def test_choice_is_the_known_best_cut_in_between():
    # Target: 1 + 0.02 per row; draft forward 0.1; hazard 0.7; 4 requests.
    # Rows per request at cut d: 1, 3, 7, 15. Step seconds: 1.08, 1.34, 1.76, 2.50;
    # tokens: 4 * (1, 1.7, 2.19, 2.533) -> rates 3.70, 5.07, 4.98, 4.05: depth 1 wins, depth 2 close.
    chooser = chooser_with(target_per_token=0.02, target_fixed=1.0, draft_per_forward=0.1, hazard=0.7)
    (rates,) = chooser.rates([2] * 4)
    tokens = 4 * np.array([1, 1.7, 1 + 0.7 + 0.49, 1 + 0.7 + 0.49 + 0.343])
    seconds = np.array([1 + 0.02 * 4 * r + 0.1 * d for d, r in enumerate([1, 3, 7, 15])])
    assert rates == pytest.approx(tokens / seconds, rel=1e-9)
    assert chooser.choose([2] * 4).depth == int(np.argmax(tokens / seconds)) == 1
    # With a better draft the best cut moves deeper: exhaustive check over hazards.
    for hazard in (0.3, 0.8, 0.95):
        chooser = chooser_with(target_per_token=0.02, target_fixed=1.0, draft_per_forward=0.1, hazard=hazard)
        surv = np.cumprod([hazard] * 3)
        tokens = 4 * (1 + np.concatenate([[0], np.cumsum(surv)]))
        assert chooser.choose([2] * 4).depth == margin_argmax(tokens / seconds), hazard


def greedy_and_hot_chooser():
    """Target 1 + 0.02 s per row, 0.1 s per draft forward (2x3); greedy requests
    (band 0) whose drafts are all kept, hot ones (band 3) whose drafts never are."""
    chooser = chooser_with(target_per_token=0.02, target_fixed=1.0, draft_per_forward=0.1, hazard=0.7)
    chooser.shapes[0].acceptance.observe([0] * 400, [3] * 400, [3] * 400)
    chooser.shapes[0].acceptance.observe([3] * 400, [3] * 400, [0] * 400)
    return chooser


def by_hand_rate(chooser, bands, depths) -> float:
    """``greedy_and_hot_chooser``'s tokens per second with ``depths`` [R], from its fake forwards."""
    tokens = chooser.shapes[0].acceptance.expected_tokens(bands)[np.arange(len(bands)), depths].sum()
    return tokens / (1 + 0.02 * np.cumsum(WIDTHS_2X3)[depths].sum() + 0.1 * depths.max())


@pytest.mark.parametrize("exhaustive_mixes", [tree_choice.EXHAUSTIVE_MIXES, 1], ids=["every-mix", "ascent"])
def test_choice_weighs_each_request_by_its_band(monkeypatch, exhaustive_mixes):
    """Each band's depth, priced over every mix at once or (more bands and depths
    than ``EXHAUSTIVE_MIXES`` mixes) by coordinate ascent: the best mix here."""
    monkeypatch.setattr(tree_choice, "EXHAUSTIVE_MIXES", exhaustive_mixes)
    chooser = greedy_and_hot_chooser()
    # Greedy: tokens 4 * (1, 2, 3, 4) over 1.08, 1.34, 1.76, 2.50 s: depth 2 (6.8/s) beats 3 (6.4/s).
    assert chooser.choose([0] * 4).depth == 2 and chooser.request_depths is None
    assert chooser.choose([3] * 4).depth == 0
    # Every mix: one depth per band (exhaustive by hand), if that beats no speculation by the margin.
    for mix in itertools.product([0, 3], repeat=4):
        bands = np.array(mix)
        best = max(
            (np.where(bands == 0, *d) for d in itertools.product(range(4), repeat=2)),
            key=lambda depths: by_hand_rate(chooser, bands, depths),
        )
        plain = np.zeros(4, dtype=np.int64)
        if by_hand_rate(chooser, bands, best) <= by_hand_rate(chooser, bands, plain) * (1 + SPECULATION_MARGIN):
            best = plain
        cut = chooser.choose(mix)
        depths = chooser.request_depths if chooser.request_depths is not None else np.full(4, cut.depth)
        assert depths.tolist() == best.tolist() and cut.depth == best.max(), (mix, cut, depths, best)


def test_mixed_work_runs_each_request_its_own_rows_and_drafts_to_its_cut():
    model = StepCostModel(ForwardCost([1, 1000], [0.0, 1.0]), ForwardCost([1, 1000], [0.0, 0.5]), WIDTHS_2X3)
    # Rows per request at cuts 0..3: 1, 3, 7, 15; the request at depth 0 drafts nothing;
    # draft level j (widths 1, 2, 4) runs the requests cut below j: 3, 2, 1 of them.
    assert model.mixed_work([0, 2, 3, 1]) == StepWork(target_tokens=26, draft_tokens=[3, 4, 4])
    assert model.mixed_work([0, 2], counts=[5, 2]) == StepWork(target_tokens=5 + 14, draft_tokens=[2, 4])
    assert model.mixed_work([0] * 4) == model.work(4, 0)
    for depth in range(4):
        assert model.mixed_work([depth], counts=[3]) == model.work(3, depth)


def test_every_mix_is_priced_as_the_step_it_runs():
    """``mixes_seconds`` prices each mix of depths (``DepthMixes``) as the step
    ``mixed_work`` says it runs, at its deepest cut's correction; conservatively,
    at a batch size unseen, no less than the plain correction plus the seconds per
    tree row measured elsewhere."""
    target, draft = ForwardCost([1, 8, 64], [1.0, 1.2, 3.0]), ForwardCost([1, 8, 64], [0.1, 0.15, 0.6])
    for tokens in (0, 1, 5, 8, 30, 64, 100):
        assert target.many(np.array([tokens]))[0] == pytest.approx(target(tokens), rel=1e-12)
    cost = StepCostModel(target, draft, WIDTHS_2X3)
    cost.observe(0, cost.work(1, 0), 1.1)
    cost.observe(2, cost.work(1, 2), 2.0)
    extra = (2.0 - cost.raw_seconds(cost.work(1, 2)) * 1.1) / 6  # beyond a plain step's correction, per tree row
    counts = [3, 1, 2]
    mixes = DepthMixes.every(3, 4)
    assert sorted(map(tuple, mixes.depths.tolist())) == list(itertools.product(range(4), repeat=3))
    for conservative in (False, True):
        got = cost.mixes_seconds(mixes, counts, conservative)
        for mix, seconds in zip(mixes.depths.tolist(), got):
            work = cost.mixed_work(mix, counts)
            want = cost.raw_seconds(work) * cost.factor(max(mix), 6)
            if conservative and max(mix):
                want = max(want, cost.raw_seconds(work) * 1.1 + extra * (work.target_tokens - 6))
            assert seconds == pytest.approx(want, rel=1e-12), (mix, conservative)
    some = DepthMixes(np.array([[3, 0, 1], [0, 0, 0]]), 4)  # any list of mixes
    assert some.deepest.tolist() == [3, 0]
    assert cost.mixes_seconds(some, counts).tolist() == [cost.mixes_seconds(mixes, counts)[k] for k in (49, 0)]


def test_each_temperature_band_gets_its_own_depth():
    """Greedy and hot requests in one batch: the hot ones get no tree, the greedy
    ones the depth that is best for the batch, which beats one depth for all by
    far; a batch where one depth for all would not speculate at all speculates
    for its greedy requests alone."""
    chooser = greedy_and_hot_chooser()
    uniform_plain = 0
    for bands in ([0, 0, 3, 3], [0, 0, 3, 3, 3, 3], [0, 0, 0, 0, 0, 3], [3, 0] * 8):
        bands = np.array(bands)
        (uniform,) = chooser.rates(bands)
        uniform_plain += margin_argmax(uniform) == 0
        cut = chooser.choose(bands)
        depths = chooser.request_depths
        assert depths is not None and depths.max() == cut.depth > 0, (bands, cut, depths)
        greedy, hot = depths[bands == 0], depths[bands == 3]
        assert (hot == 0).all() and len(set(greedy)) == 1 and greedy[0] > 0, (bands, depths)
        assert by_hand_rate(chooser, bands, depths) > 1.05 * uniform.max()
    assert uniform_plain >= 2  # one depth for all would not have speculated in two of these batches


def test_exploration_spends_its_share_of_the_time_on_each_candidate_in_turn():
    """Exploration is priced: each decision earns 2 % of its step's predicted time,
    and a trial runs once that covers what it is predicted to lose against the
    choice (at least half a step). While the chain cut to 3 is chosen, the
    candidates come in turn: no speculation, then the tree's best cut (the chain
    has no deeper cut). Over 2000 decisions, the trials' losses add up to 2 % of
    the time, give or take one trial."""
    chooser = shapes_chooser(0.01, 1.0, 0.05, hazards=(0.7, 0.8), explore=0.02)
    picks = [chooser.choose([2] * 4) for _ in range(2000)]
    choice = Cut(0, 3)
    (chain, tree) = chooser.rates([2] * 4)
    rate = chain[3]
    step = 4 * chooser.shapes[0].acceptance.expected_tokens([2])[0, 3] / rate
    loss = {}
    for cut, rates in ((Cut(1, 0), tree), (Cut(1, 2), tree)):
        seconds = chooser.shapes[cut.shape].cost.seconds(4, cut.depth, conservative=True)
        loss[cut] = max(seconds - rates[cut.depth] * seconds / rate, tree_choice.MIN_TRIAL_PRICE * step)
    trials = [p for p in picks if p != choice]
    assert set(trials) == set(loss) and trials[0::2] == [Cut(1, 0)] * len(trials[0::2]), trials
    spent = sum(loss[t] for t in trials)
    assert spent <= 0.02 * step * len(picks) <= spent + max(loss.values()), (spent, len(trials))


def shapes_chooser(target_per_token, target_fixed, draft_per_forward, hazards, explore=0):
    """Two shapes of max_tree 2x3: its chain 1x3 and 2x3 itself, each with its own hazard."""
    target = ForwardCost([1, 10_000], [target_fixed + target_per_token, target_fixed + 10_000 * target_per_token])
    draft = ForwardCost([1, 10_000], [draft_per_forward, draft_per_forward])
    shapes = []
    for tree, hazard in zip(TreeSpec.parse("2x3").width_cuts(), hazards):
        acceptance = AcceptanceModel(tree.max_depth, prior_hazard=hazard, prior_weight=1.0)
        shapes.append(ShapeModels(StepCostModel(target, draft, tree.nodes_per_depth), acceptance))
    return TreeChooser(shapes, explore_share=explore, reprice_every=1)


def test_width_cuts_of_a_tree():
    assert [t.nodes_per_depth for t in TreeSpec.parse("2x3").width_cuts()] == [[1, 1, 1, 1], WIDTHS_2X3]
    assert [t.nodes_per_depth for t in TreeSpec.parse("3x2").width_cuts()] == [[1, 1, 1], [1, 2, 4], [1, 3, 9]]
    assert TreeSpec.parse("1x4").width_cuts() == [TreeSpec.parse("1x4")]
    # Irregular: slot 0 reaches depth 1 only, so the chain is shallower than the tree.
    irregular = TreeSpec.parse([[0], [1], [1, 0], [1, 1]])
    assert [t.paths for t in irregular.width_cuts()] == [((), (0,)), irregular.paths]


def exhaustive_best(target_per_token, target_fixed, draft_per_forward, hazards, reqs=4):
    """argmax over (shape, depth) of tokens / seconds, written out by hand; a
    speculating cut only if it beats no speculation by ``SPECULATION_MARGIN``."""
    best, best_rate = None, 0.0
    plain = reqs / (target_fixed + target_per_token * reqs)
    for s, (widths, hazard) in enumerate(zip([[1, 1, 1, 1], WIDTHS_2X3], hazards)):
        for d in range(1, 4):
            rows = sum(widths[: d + 1])
            seconds = target_fixed + target_per_token * reqs * rows + draft_per_forward * d
            tokens = reqs * (1 + sum(hazard**k for k in range(1, d + 1)))
            if tokens / seconds > best_rate:
                best, best_rate = (s, d), tokens / seconds
    return Cut(*best) if best_rate > plain * (1 + SPECULATION_MARGIN) else Cut(1, 0)


def test_choice_takes_the_chain_where_rows_cost_and_the_tree_where_they_are_free():
    # Rows expensive (a compute-bound CPU): the chain's 1 row per depth beats two per parent.
    chooser = shapes_chooser(0.05, 1.0, 0.05, hazards=(0.7, 0.8))
    assert chooser.choose([2] * 4) == exhaustive_best(0.05, 1.0, 0.05, (0.7, 0.8)) == Cut(0, 3)
    # Rows nearly free (a launch-bound GPU at batch 4): the wide tree's higher acceptance wins.
    chooser = shapes_chooser(1e-5, 1.0, 0.05, hazards=(0.7, 0.8))
    assert chooser.choose([2] * 4) == exhaustive_best(1e-5, 1.0, 0.05, (0.7, 0.8)) == Cut(1, 3)
    # Every cost and hazard on a grid: the choice is the exhaustive argmax.
    for per_token, draft, h_chain, h_tree in itertools.product(
        (1e-4, 0.01, 0.05, 0.3), (0.01, 0.2, 1.0), (0.3, 0.6, 0.9), (0.5, 0.8, 0.95)
    ):
        chooser = shapes_chooser(per_token, 1.0, draft, hazards=(h_chain, h_tree))
        expected = exhaustive_best(per_token, 1.0, draft, (h_chain, h_tree))
        assert chooser.choose([2] * 4) == expected, (per_token, draft, h_chain, h_tree)


def test_choice_keeps_to_the_allowed_shapes():
    """Structured outputs: the full tree only (its depth cuts, or no speculation)."""
    chooser = shapes_chooser(0.05, 1.0, 0.05, hazards=(0.7, 0.8), explore=1)
    for _ in range(6):
        assert chooser.choose([2] * 4, allowed={1}).shape == 1


def test_a_trial_from_plain_steps_is_one_requests_until_it_has_caught_up():
    """Under load, plain steps chosen: a trial speculates for the one request the
    draft is least behind on (its catch-up is the cheapest), and goes on, for it
    alone, until it has caught up and drafted the tree that measures the cut; the
    others stay plain throughout."""
    # Speculation never chosen (low acceptance), but a trial's ceiling beats plain: one
    # request at depth 1 of the chain, its draft accepted, 17 tokens in 1.173 s against 16 in 1.16.
    chooser = shapes_chooser(0.01, 1.0, 0.003, hazards=(0.05, 0.05), explore=0.02)
    ids = [f"r{i}" for i in range(16)]
    behind = np.full(16, 200)
    behind[5] = 40
    picks, behind_before = [], []
    for _ in range(400):
        behind_before.append(int(behind[5]))
        cut = chooser.choose([2] * 16, backlog=int(behind.sum()), req_ids=ids, behind=behind)
        depths = chooser.request_depths
        picks.append((cut, None if depths is None else depths.tolist()))
        if cut.depth:
            assert depths is not None and np.count_nonzero(depths) == 1 and depths[5] == cut.depth, picks[-1]
            behind[5] = max(behind[5] - 16, 0)  # the drafter catches up 16 tokens a step, then drafts
        else:
            behind[5] += 1
    runs, run = [], []  # each trial's steps: (its request's tokens behind at the decision)
    for (cut, _), before in zip(picks, behind_before):
        if cut.depth:
            run.append(before)
        elif run:
            runs.append(run)
            run = []
    assert len(runs) >= 2, picks
    for run in runs:  # until the decision that finds it caught up (the step that measures), no longer
        assert all(b > 1 for b in run[:-1]) and run[-1] <= 1, runs
    # Each trial priced at least half a step (the catch-up is free here): 2 % of 400 steps pays for 16.
    assert len(runs) <= chooser.trials <= 400 * 0.02 / tree_choice.MIN_TRIAL_PRICE + 1, (chooser.trials, runs)


def test_prior_hazards_grow_with_the_children_per_node():
    assert prior_hazards([1, 1, 1, 1]) == pytest.approx([0.7, 0.7, 0.7])
    assert prior_hazards(WIDTHS_2X3) == pytest.approx([0.91, 0.91, 0.91])
    assert prior_hazards([1, 3, 6]) == pytest.approx([1 - 0.3**3, 1 - 0.3**2])
    model = AcceptanceModel(3, prior_hazards(WIDTHS_2X3), prior_weight=4.0)
    assert model.hazards()[2] == pytest.approx([0.91] * 3)


def test_an_unseen_plain_step_is_not_charged_the_speculating_overheads():
    """Speculating steps run 2x their forwards' timing (drafting, verification);
    a plain step never run yet is predicted at its timing (what start-up measured),
    and an unseen speculating depth at the speculating ones' correction."""
    flat = ForwardCost([1, 100], [1.0, 1.0])
    model = StepCostModel(flat, flat, WIDTHS_2X3, window=5)
    model.observe(2, model.work(1, 2), 6.0)  # predicted 3.0: correction 2
    assert model.seconds(1, 0) == pytest.approx(1.0)
    assert model.seconds(1, 1) == pytest.approx(4.0)  # 2.0 raw, the speculating correction 2
    model.observe(0, model.work(1, 0), 1.3)
    assert model.seconds(1, 0) == pytest.approx(1.3)
    assert model.seconds(1, 3) == pytest.approx(8.0)  # speculating depths keep their own evidence
    model.observe(1, model.work(1, 1), 6.0)  # correction 3 at depth 1
    assert model.seconds(1, 3) == pytest.approx(10.0)  # unseen: the mean speculating correction, 2.5


def test_corrections_are_kept_per_batch_size():
    """What a speculating step costs beyond its forwards grows with the batch on a
    compute-bound CPU: batch 8 learns its own corrections, and until it has, an
    unseen cut there borrows batch 8's other cuts before any other batch's."""
    flat = ForwardCost([1, 1000], [1.0, 1.0])
    model = StepCostModel(flat, flat, WIDTHS_2X3)
    model.observe(1, model.work(1, 1), 2.4, num_requests=1)  # predicted 2.0: 1.2 at batch 1
    assert model.seconds(8, 1) == pytest.approx(2.4)  # batch 8 unseen: batch 1's evidence
    model.observe(2, model.work(8, 2), 15.0, num_requests=8)  # predicted 3.0: 5.0 at batch 8
    assert model.seconds(1, 1) == pytest.approx(2.4)
    assert model.seconds(8, 1) == pytest.approx(10.0)  # batch 8's own speculating correction
    assert model.seconds(12, 2) == pytest.approx(15.0)  # 12 requests: the same bucket as 8 (8-15)
    assert model.seconds(2, 2) == pytest.approx(3.0 * (1.2 + 5.0) / 2)  # bucket 2 unseen: every size's mean
    assert model.seconds(8, 0) == pytest.approx(1.0)


def test_an_unseen_shape_borrows_the_other_shapes_speculating_corrections():
    """The chain has run at batch 8 and cost 3x its forwards; the whole tree has not
    run there yet. Its cuts are charged the chain's correction (what speculating
    adds beyond the forwards), not the start-up timing alone, so the choice does
    not try a tree that the chain's evidence already says cannot pay; its own
    evidence, once seen, comes first."""
    flat = ForwardCost([1, 1000], [1.0, 1.0])
    chain = ShapeModels(StepCostModel(flat, flat, [1, 1, 1, 1]), AcceptanceModel(3, [0.9] * 3))
    tree = ShapeModels(StepCostModel(flat, flat, WIDTHS_2X3), AcceptanceModel(3, [0.95] * 3))
    chooser = TreeChooser([chain, tree], explore_share=0)
    chain.cost.observe(1, chain.cost.work(8, 1), 6.0, num_requests=8)  # predicted 2.0: 3x
    chain.cost.observe(0, chain.cost.work(8, 0), 1.0, num_requests=8)
    tree.cost.observe(0, tree.cost.work(8, 0), 1.0, num_requests=8)
    assert tree.cost.seconds(8, 2) == pytest.approx(3 * 3.0)
    assert chooser.choose(np.ones(8, dtype=np.int64)) == Cut(1, 0)  # no speculation
    tree.cost.observe(2, tree.cost.work(8, 2), 4.5, num_requests=8)  # its own: 1.5x
    assert tree.cost.seconds(8, 1) == pytest.approx(1.5 * 2.0)
    assert chain.cost.seconds(8, 2) == pytest.approx(3 * 3.0)  # the chain's own evidence first


def test_the_drafts_catch_up_is_spread_over_the_tokens_left():
    """Speculating after plain steps first runs every token the draft has not
    seen through it (new prompts, plain steps' tokens). Spread over many tokens
    left it barely changes the rates; over a few it makes no speculation pay;
    exactly at the rates the formula gives."""
    chooser = chooser_with(target_per_token=0.02, target_fixed=1.0, draft_per_forward=0.1, hazard=0.7)
    chooser.shapes[0].cost.draft = ForwardCost([1, 10_000], [0.1, 0.1 + 9_999 * 1e-3])  # 1 ms a token
    assert chooser.choose([2] * 4).depth == 1
    (rates,) = chooser.rates([2] * 4, backlog=600, tokens_left=8)
    tokens = 4 * np.array([1, 1.7, 1 + 0.7 + 0.49, 1 + 0.7 + 0.49 + 0.343])
    draft = [0.1 + (4 * w - 1) * 1e-3 for w in WIDTHS_2X3]  # level j's forward: 4 w_j tokens
    seconds = np.array([1 + 0.02 * 4 * r + sum(draft[:d]) for d, r in enumerate([1, 3, 7, 15])])
    steps = np.maximum(8 * 4 / tokens, 1.0)
    seconds[1:] += 0.6 / steps[1:]  # 600 tokens at 1 ms
    assert rates == pytest.approx(tokens / seconds, rel=1e-9)
    # 3 s of catch-up: over 8 tokens left (4.7 steps at depth 1) no cut pays, over 32 depth 1 does.
    assert chooser.choose([2] * 4, backlog=3000, tokens_left=8).depth == 0
    assert chooser.choose([2] * 4, backlog=3000, tokens_left=32).depth == 1
    assert chooser.choose([2] * 4, backlog=3000).depth == 1  # no max_tokens: unbounded


def test_a_trial_is_charged_the_whole_catch_up():
    """Exploring a speculating cut from plain steps runs the draft's catch-up first,
    which is lost if the cut does not pay: the trial is charged all of it (taken off
    the allowance), so it waits until the allowance covers that too."""

    def first_trial(behind) -> tuple[int, float]:
        chooser = chooser_with(target_per_token=0.02, target_fixed=1.0, draft_per_forward=0.1, hazard=0.1, explore=0.02)
        chooser.shapes[0].cost.draft = ForwardCost([1, 10_000], [0.1, 0.1 + 9_999 * 1e-3])
        (rates,) = chooser.rates([2] * 4)
        assert int(np.argmax(rates)) == 0  # poor acceptance: plain is the choice
        for decision in range(2000):
            before = chooser.allowance
            if chooser.choose([2] * 4, req_ids=list("abcd"), behind=np.full(4, behind)).depth:
                return decision, before - chooser.allowance
        raise AssertionError("no trial")

    (early, charged), (late, charged_catch_up) = first_trial(0), first_trial(1000)
    # 1000 tokens through the draft: 1 s more, some 46 decisions' allowance (2 % of a 1.08 s plain step).
    assert charged_catch_up >= 1.0 and charged_catch_up > charged, (charged, charged_catch_up)
    assert late - early >= (charged_catch_up - charged) / (0.02 * 1.08) - 8, (early, late)  # kept choices: <= 8


def test_an_unseen_batch_size_is_committed_to_on_the_rows_extra_cost():
    """Batch 1 ran depth 2 at 0.5 s beyond its forwards (6 tree rows). At batch 8,
    unseen, the optimistic estimate borrows batch 1's factor; the conservative
    one its seconds per tree row, 8 x the rows: the choice goes by the
    conservative one (no speculation); a trial needs its forwards' time alone."""
    target, draft = ForwardCost([1, 1000], [1.0, 1.0]), ForwardCost([1, 1000], [0.1, 0.1])
    cost = StepCostModel(target, draft, WIDTHS_2X3)
    chooser = TreeChooser([ShapeModels(cost, AcceptanceModel(3, [0.9] * 3, prior_weight=1.0))])
    cost.observe(0, cost.work(1, 0), 1.0, num_requests=1)
    cost.observe(2, cost.work(1, 2), 1.7, num_requests=1)  # predicted 1.2: factor 1.7 / 1.2, 0.5 / 6 s per row
    assert cost.seconds(8, 2) == pytest.approx(1.7)
    assert cost.seconds(8, 2, conservative=True) == pytest.approx(1.2 + 48 * 0.5 / 6)
    assert cost.seconds(8, 1, conservative=True) == pytest.approx(1.1 + 16 * 0.5 / 6)  # depth 1 unseen: any depth's
    assert cost.seconds(1, 2, conservative=True) == pytest.approx(1.7)  # seen: its own factor
    assert chooser.choose([2]) == Cut(0, 2)  # batch 1: 2.71 tokens in 1.7 s
    # Batch 8: optimistic, depth 1 gives 15.2 tokens in 1.56 s; conservative, in 2.43 s: plain (8 in 1 s).
    assert chooser.choose([2] * 8) == Cut(0, 0)
    # A trial, 16 tokens in 1.1 s (its forwards alone), could beat 8 in 1 s: the allowance covering
    # it, it runs for the batch (no requests named), one step (nothing to catch up), then plain again.
    make_trial_due(chooser)
    picks = [chooser.choose([2] * 8)]
    chooser.allowance = 0.0
    picks += [chooser.choose([2] * 8) for _ in range(2)]
    assert picks == [Cut(0, 1), Cut(0, 0), Cut(0, 0)], picks
    # Once batch 8 has run a cut, its own evidence decides.
    cost.observe(1, cost.work(8, 1), 1.3, num_requests=8)
    assert cost.seconds(8, 1, conservative=True) == pytest.approx(1.3)
    chooser.explore_share = 0
    assert chooser.choose([2] * 8) == Cut(0, 1)


def test_the_draft_backlog_is_what_the_draft_has_not_run():
    """The sizer's inputs to the choice, from the runner's batch: tokens the draft
    has not run (a new request: its whole prompt; one drafted every step: none),
    and the median tokens left to generate (no max_tokens: unbounded)."""
    from types import SimpleNamespace

    from vllm_univer.integration.tree_sizer import TreeSizer

    def request(max_tokens, generated):
        return SimpleNamespace(sampling_params=SimpleNamespace(max_tokens=max_tokens), output_token_ids=[0] * generated)

    runner = SimpleNamespace(
        input_batch=SimpleNamespace(
            req_ids=["new", "drafted", "plain", "gone"], num_tokens_no_spec=np.array([120, 300, 80, 9])
        ),
        requests={
            "new": request(64, 0),
            "drafted": request(100, 40),
            "plain": request(None, 10),
            "gone": request(5, 5),
        },
    )
    sizer = TreeSizer.__new__(TreeSizer)
    sizer.runner = runner
    sizer.drafter = SimpleNamespace(state=SimpleNamespace(draft_kv_len={"drafted": 300, "plain": 70}))
    behind, left = sizer._draft_backlog(3)  # the batch's first three rows
    assert behind.tolist() == [120, 0, 10]
    assert left == 64  # median of 64, 60 and unbounded
    behind, left = sizer._draft_backlog(2)
    assert behind.tolist() == [120, 0] and left == 62.0


def test_a_speculating_cut_must_beat_no_speculation_by_the_margin():
    """Near a tie the estimates' errors decide: a cut predicted 4 % faster than
    plain steps is not taken, one 7 % faster is."""
    assert SPECULATION_MARGIN == 0.05
    for gain, depth in ((1.04, 0), (1.07, 1)):
        # Plain: 4 tokens in 1 s. Depth 1: 4 * (1 + h) tokens in 1.5 s.
        target, draft = ForwardCost([1, 1000], [1.0, 1.0]), ForwardCost([1, 1000], [0.5, 0.5])
        hazard = 1.5 * gain - 1
        chooser = TreeChooser(
            [ShapeModels(StepCostModel(target, draft, [1, 1]), AcceptanceModel(1, hazard, prior_weight=1.0))],
            explore_share=0,
        )
        (rates,) = chooser.rates([2] * 4)
        assert rates[1] / rates[0] == pytest.approx(gain)
        assert chooser.choose([2] * 4).depth == depth


def test_fixed_hazards_hook_sets_the_acceptance_and_freezes_it(monkeypatch):
    """``VLLM_UNIVER_AUTO_HAZARDS`` (``benchmarks/gpu_engine.py`` on random-weight
    models): each width's acceptance is the given hazards in every band (or per
    band), and verified trees change nothing; a malformed value is a clear error."""
    import json
    from types import SimpleNamespace

    from vllm_univer.integration.tree_sizer import FIXED_HAZARDS_ENV, TreeSizer

    runner = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1), device="cpu")
    shapes = TreeSpec.parse("2x3").width_cuts()
    monkeypatch.setenv(FIXED_HAZARDS_ENV, json.dumps({"1": [0.7, 0.5, 1.0], "2": [0.9, 0.8, 0.5]}))
    sizer = TreeSizer(runner, shapes, drafter=None)
    chain = [1, 1.7, 1.7 + 0.35, 1.7 + 0.35 + 0.35]
    tree = [1, 1.9, 1.9 + 0.72, 1.9 + 0.72 + 0.36]
    for band in range(4):
        assert sizer.acceptance[0].expected_tokens([band])[0] == pytest.approx(chain)
        assert sizer.acceptance[1].expected_tokens([band])[0] == pytest.approx(tree)
    sizer.observe_acceptance(shapes[1], np.array([1.0, 0.0]), [3, 3], [0, 0])
    assert sizer.acceptance[1].expected_tokens([2, 0]) == pytest.approx(np.array([tree, tree]))
    # Per temperature band: greedy requests keep every draft, the others none.
    per_band = {str(band): [1.0 if band == 0 else 0.0] * 3 for band in range(4)}
    monkeypatch.setenv(FIXED_HAZARDS_ENV, json.dumps({"1": per_band, "2": per_band}))
    sizer = TreeSizer(runner, shapes, drafter=None)
    for model in sizer.acceptance:
        assert model.expected_tokens([0, 1, 2, 3]) == pytest.approx(np.array([[1, 2, 3, 4]] + [[1, 1, 1, 1]] * 3))
    bad_bands = ({"1": {"0": [0.7] * 3}, "2": [0.9] * 3}, {"1": {**per_band, "3": [0.7]}, "2": [0.9] * 3})
    for bad in (
        {"2": [0.9, 0.8, 0.5]},
        {"1": [0.7, 0.5], "2": [0.9, 0.8, 0.5]},
        {"1": [0.7] * 3, "2": [1.2] * 3},
        *bad_bands,
    ):
        monkeypatch.setenv(FIXED_HAZARDS_ENV, json.dumps(bad))
        with pytest.raises(ValueError, match="needs 3 hazards in \\[0, 1\\] for width"):
            TreeSizer(runner, shapes, drafter=None)
    monkeypatch.delenv(FIXED_HAZARDS_ENV)
    learning = TreeSizer(runner, shapes, drafter=None)
    learning.observe_acceptance(shapes[1], np.array([1.0]), [3], [0])
    assert learning.acceptance[1].hazards()[2, 0] < prior_hazards(shapes[1].nodes_per_depth)[0]


def test_dynamic_trees_are_a_candidate_of_their_own(monkeypatch):
    """With a budget, tree "auto"'s candidates include the levels of context-aware
    trees: named "dyn" in the hooks (fixed hazards, the width schedule: 0) and in the
    summaries, learnt like any shape, never a source of the chain's estimate."""
    import json
    from types import SimpleNamespace

    from vllm_univer.core.tree_batch import LevelLayout
    from vllm_univer.integration.tree_sizer import FIXED_HAZARDS_ENV, TreeSizer, shape_label

    runner = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1), device="cpu")
    chain, full = TreeSpec.parse("2x3").width_cuts()
    layout = LevelLayout((1, 2, 4, 4), 2)
    shapes = [chain, layout, full]
    assert [shape_label(s) for s in shapes] == [1, "dyn", 2]
    monkeypatch.setenv(FIXED_HAZARDS_ENV, json.dumps({"1": [0.7] * 3, "2": [0.9] * 3, "dyn": [0.5, 0.5, 0.0]}))
    sizer = TreeSizer(runner, shapes, drafter=None)
    assert sizer.acceptance[1].expected_tokens([2])[0] == pytest.approx([1, 1.5, 1.75, 1.75])
    monkeypatch.delenv(FIXED_HAZARDS_ENV)
    learning = TreeSizer(runner, shapes, drafter=None)
    assert learning.estimates_chain(full) and not learning.estimates_chain(layout)
    before = learning.acceptance[1].hazards()[2, 0]
    learning.observe_acceptance(layout, np.array([1.0]), [3], [0])
    assert learning.acceptance[1].hazards()[2, 0] < before
    learning.set_schedule(None, "0,2")
    with pytest.raises(ValueError, match="must lie in 1"):
        TreeSizer(runner, [chain, full], drafter=None).set_schedule(None, "0,2")


def sizer_on_a_fake_runner(temperatures, one_cut_per_step: bool = False) -> tuple:
    """(``TreeSizer`` of 2x3 and its chain on a fake runner whose batch has one request
    per temperature, forwards that cost 1 + 0.02 s per target row and 0.1 s per draft
    forward, exploration off; the batch's request ids)."""
    from types import SimpleNamespace

    from vllm_univer.integration.tree_sizer import TreeSizer

    batch = len(temperatures)
    req_ids = [f"r{i}" for i in range(batch)]
    params = SimpleNamespace(max_tokens=None, structured_outputs=None)
    runner = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        device="cpu",
        input_batch=SimpleNamespace(
            num_reqs=batch,
            temperature_cpu=np.asarray(temperatures, dtype=np.float64),
            req_ids=req_ids,
            num_tokens_no_spec=np.full(batch, 10),
        ),
        requests={r: SimpleNamespace(sampling_params=params, output_token_ids=[]) for r in req_ids},
        query_start_loc=SimpleNamespace(np=np.arange(batch + 1)),
    )
    drafter = SimpleNamespace(
        state=SimpleNamespace(draft_kv_len=dict.fromkeys(req_ids, 10)), forward_tokens=[], chunk_tokens=0
    )
    shapes = TreeSpec.parse("2x3").width_cuts()
    sizer = TreeSizer(runner, shapes, drafter, one_cut_per_step=one_cut_per_step)
    target = ForwardCost([1, 10_000], [1.02, 1.0 + 10_000 * 0.02])
    draft = ForwardCost([1, 10_000], [0.1, 0.1])
    sizer.chooser = TreeChooser(
        [ShapeModels(StepCostModel(target, draft, s.nodes_per_depth), a) for s, a in zip(shapes, sizer.acceptance)],
        explore_share=0,
    )
    return sizer, req_ids


def test_calibration_times_the_target_graph_a_step_replays():
    """``TreeSizer.calibrate`` times the target's forward at 1, 2, 4, ... tokens through
    vLLM's dummy runs: under full CUDA graphs with graphs per cut length
    (``full_graph_lengths``), as a uniform batch of one-token requests where the
    graph of that many is captured (what a step of one cut replays), with the runner's
    length restored after each; piecewise beyond (and without such graphs)."""
    from types import SimpleNamespace

    import torch

    from vllm_univer.integration.full_graph_lengths import FullGraphLengths
    from vllm_univer.integration.tree_sizer import CALIBRATION_PASSES, TreeSizer

    for graphs in (None, FullGraphLengths({1, 3, 7}, 15, max_tokens=512, max_reqs=8)):
        runs = []

        class Proposer:  # vLLM's: dummy_run a method, shadowed on the instance while the target runs
            def dummy_run(self, n, runs=runs, **kwargs):
                runs.append(("draft", n))

        proposer = Proposer()
        runner = SimpleNamespace(
            parallel_config=SimpleNamespace(tensor_parallel_size=1),
            scheduler_config=SimpleNamespace(max_num_batched_tokens=2048, max_num_seqs=8),
            device=torch.device("cpu"),
            drafter=proposer,
            cudagraph_dispatcher=SimpleNamespace(univer_full_graphs=graphs),
            uniform_decode_query_len=15,
        )

        def dummy_run(n, uniform_decode=False, runner=runner, runs=runs):
            runs.append(("target", n, uniform_decode, runner.uniform_decode_query_len))
            runner.drafter.dummy_run(n)  # as vLLM's dummy run does: shadowed, the target's forward alone

        runner._dummy_run = dummy_run
        shapes = TreeSpec.parse("2x3").width_cuts()
        sizer = TreeSizer(runner, shapes, SimpleNamespace(state=None, forward_tokens=[], chunk_tokens=0))
        sizer.calibrate()
        assert sizer.calibration["tokens"] == [1, 2, 4, 8, 16, 32, 64, 120]  # up to 8 requests x 15 tokens
        timed = {(run[1], run[2], run[3]) for run in runs if run[0] == "target"}
        for n in sizer.calibration["tokens"]:
            replays = graphs is not None and n <= 8  # graphs of 1, 2, 4, 8 one-token requests
            assert (n, replays, 1 if replays else 15) in timed, (graphs, n, timed)
        assert runner.uniform_decode_query_len == 15 and sizer.chooser is not None
        # The draft's own runs only: a warm-up, then every size per pass.
        assert sum(run[0] == "draft" for run in runs) == 1 + CALIBRATION_PASSES * len(sizer.calibration["tokens"])


def test_the_sizer_hands_each_request_its_band_depth(monkeypatch):
    """``TreeSizer.choose`` on a fake runner (greedy and T = 1 rows in turn, acceptance
    fixed per band: greedy drafts always kept, sampled ones never; fake forwards):
    the greedy rows get a tree, the sampled ones none, in the same step; with
    ``ONE_DEPTH_ENV``, or one cut per step (full CUDA graphs), one depth for all."""
    import json

    from vllm_univer.integration.tree_sizer import FIXED_HAZARDS_ENV, ONE_DEPTH_ENV

    per_band = {str(band): [1.0 if band == 0 else 0.0] * 3 for band in range(4)}
    monkeypatch.setenv(FIXED_HAZARDS_ENV, json.dumps({"1": per_band, "2": per_band}))
    for one_depth in ("0", "1", "full graphs"):
        monkeypatch.setenv(ONE_DEPTH_ENV, "0" if one_depth == "full graphs" else one_depth)
        sizer, _ = sizer_on_a_fake_runner([0.0, 1.0] * 2, one_cut_per_step=one_depth == "full graphs")
        shape, depth = sizer.choose(4)
        if one_depth != "0":
            assert np.ndim(depth) == 0, depth
            continue
        assert shape in sizer.shapes and depth.tolist() == [depth[0], 0, depth[0], 0] and depth[0] > 0, depth
        assert sizer.requests_at_depth == {0: 2, int(depth[0]): 2}


def test_scheduled_depths_per_row_or_one_per_step(monkeypatch):
    """The test schedule of depth cuts: row i at decision k gets depths[(k + i) % n]
    (cuts that differ within a batch), and with ``ONE_DEPTH_ENV`` every row
    depths[k % n] (uniform batches of each cut, what full CUDA graphs per cut replay)."""
    from vllm_univer.integration.tree_sizer import ONE_DEPTH_ENV, SCHEDULE_ENV

    monkeypatch.setenv(SCHEDULE_ENV, "2,0,1")
    for one_depth in ("0", "1"):
        monkeypatch.setenv(ONE_DEPTH_ENV, one_depth)
        sizer, _ = sizer_on_a_fake_runner([1.0] * 3)
        steps = [np.broadcast_to(sizer.choose(3)[1], (3,)).tolist() for _ in range(3)]
        if one_depth == "1":
            assert sorted(map(tuple, steps)) == [(0, 0, 0), (1, 1, 1), (2, 2, 2)], steps
        else:
            assert all(sorted(row) == [0, 1, 2] for row in steps), steps


def test_each_request_learns_its_own_acceptance_from_its_band():
    """Requests of one band: a request's hazards are its band's until its own trees
    are seen, then move towards what they accepted (the band's worth
    REQUEST_PRIOR_WEIGHT trees); without ids, the band's; a finished request's
    counts are dropped and its slot reused."""
    model = AcceptanceModel(3, prior_hazard=0.5, prior_weight=1.0)
    model.observe([2] * 4, [3] * 4, [3, 0, 3, 0], req_ids=["easy", "hard", "easy", "hard"])
    band = model.expected_tokens([2])[0]
    ids = ["easy", "hard", "new"]
    easy, hard, new = model.expected_tokens([2] * 3, ids)
    assert np.array_equal(new, band) and np.array_equal(model.expected_tokens([2] * 3)[0], band)
    h = model.hazards()[2]
    w = acceptance_model.REQUEST_PRIOR_WEIGHT
    easy_h = (2.0 + w * h) / (2 + w)  # 2 trees, both accepted to depth 3
    assert easy[1:] == pytest.approx(1 + np.cumsum(np.cumprod(easy_h)))
    hard_h = np.array([w * h[0] / (2 + w), h[1], h[2]])  # 2 trees at risk at depth 1, none passed
    assert hard[1:] == pytest.approx(1 + np.cumsum(np.cumprod(hard_h)))
    assert easy[-1] > band[-1] > hard[-1]
    model.forget_requests_except({"hard": None})
    assert np.array_equal(model.expected_tokens([2], ["easy"])[0], band)
    model.observe([2], [3], [3], req_ids=["other"])  # takes the freed slot, from zero
    assert model.expected_tokens([2], ["other"])[0][-1] > model.expected_tokens([2])[0][-1]
    assert model._request_counts.shape[1] == 2


def test_acceptance_groups_split_at_the_largest_gaps():
    groups = tree_choice.acceptance_groups
    assert groups(np.array([1.0, 1.0, 1.0])).tolist() == [0, 0, 0]
    assert groups(np.array([3.0, 1.0, 3.02, 1.01])).tolist() == [1, 0, 1, 0]  # gaps under 0.05: one group
    expected = np.array([4.0, 1.0, 2.0, 3.9, 2.1, 1.1, 6.0])  # sorted, gaps .1 .9 .1 1.8 .1 2.0
    assert groups(expected).tolist() == [2, 0, 1, 2, 1, 0, 3]  # at the 3 largest: 4 groups at most
    assert groups(expected, max_groups=2).tolist() == [0, 0, 0, 0, 0, 0, 1]
    assert groups(np.array([4.0, 1.0]), max_groups=1).tolist() == [0, 0]


def test_requests_of_one_band_get_depths_of_their_own():
    """One temperature band, requests whose drafts are always kept beside ones whose
    drafts never are (each learnt from its own trees): the first speculate, the
    others run plain, in the same step; valued by the band alone, one depth for all."""
    chooser = chooser_with(target_per_token=0.02, target_fixed=1.0, draft_per_forward=0.1, hazard=0.7)
    acceptance = chooser.shapes[0].acceptance
    ids = ["easy0", "hard0", "easy1", "hard1"]
    for _ in range(50):
        acceptance.observe([2] * 4, [3] * 4, [3, 0, 3, 0], req_ids=ids)
    cut = chooser.choose([2] * 4, req_ids=ids)
    depths = chooser.request_depths
    assert depths is not None and depths.tolist() == [cut.depth, 0, cut.depth, 0] and cut.depth > 0, depths
    chooser.choose([2] * 4)
    assert chooser.request_depths is None


def test_the_sizer_learns_each_requests_acceptance():
    """``TreeSizer`` on a fake runner, one temperature band: verified trees of each
    request teach the choice that two of them accept everything and two nothing;
    the next choice drafts for the first two only."""
    sizer, req_ids = sizer_on_a_fake_runner([1.0] * 4)
    for shape in sizer.shapes:
        for _ in range(50):
            sizer.observe_acceptance(shape, np.full(4, 1.0), [3] * 4, [3, 0, 3, 0], req_ids)
    _, depth = sizer.choose(4)
    assert np.ndim(depth) == 1 and depth.tolist() == [depth[0], 0, depth[0], 0] and depth[0] > 0, depth


def test_the_choice_is_made_ahead_and_learns_what_was_deferred():
    """On a GPU the sizer works while the device does: the step's choice is made once
    the target forward is launched (``choose_ahead``) and handed out at drafting time
    for the same batch; what verified trees teach is learnt once the draft forwards
    are launched (``defer``), and in any case before the next choice."""
    sizer, req_ids = sizer_on_a_fake_runner([1.0] * 4)
    for shape in sizer.shapes:
        for _ in range(50):
            learn = functools.partial(sizer.observe_acceptance, shape, np.full(4, 1.0), [3] * 4, [3, 0, 3, 0], req_ids)
            sizer.defer(learn)
    assert [a.observations for a in sizer.acceptance] == [0, 0]
    sizer.choose_ahead()
    assert [a.observations for a in sizer.acceptance] == [50, 50]
    ahead = sizer._ahead[1]
    shape, depth = sizer.choose(4)
    assert shape is ahead[0] and depth is ahead[1] and sizer.decisions_ahead == 1  # the very choice made ahead
    assert depth.tolist() == [depth[0], 0, depth[0], 0] and depth[0] > 0, depth
    sizer.choose_ahead()
    sizer.runner.input_batch.req_ids = req_ids[::-1]  # another batch by drafting time: chosen afresh
    _, depth = sizer.choose(4)
    assert sizer.decisions_ahead == 1 and sizer._decisions == 3
    assert depth.tolist() == [0, depth[1], 0, depth[1]], depth


def test_a_shape_not_yet_drafted_borrows_the_others_acceptance():
    """The chain of a 2x3 is rarely drafted while the 2x3 runs: its prior follows
    what the tree's hazards imply per child (h = 1 - (1 - s)^2), per band, until
    its own observations take over. Rows expensive: once the tree is seen to
    accept nearly everything, the chain (one row per depth) is the better cut."""
    chooser = shapes_chooser(0.05, 1.0, 0.05, hazards=(0.3, 0.91))
    chain, tree = chooser.shapes[0].acceptance, chooser.shapes[1].acceptance
    assert chooser.choose([2] * 4) == Cut(1, 1)  # the chain's prior: 4 x 1.42 tokens in 1.95 s at depth 3
    tree.observe([2] * 200, [3] * 200, [3] * 200)  # band 2: everything accepted
    assert chooser.choose([2] * 4) == Cut(0, 3)
    assert chain.hazards()[2] == pytest.approx(1.0 - np.sqrt(1.0 - tree.hazards()[2]))
    assert chain.hazards()[0] == pytest.approx([0.3] * 3)  # no evidence in the greedy band: its own prior
    chain.observe([2] * 200, [3] * 200, [0] * 200)  # its own trials: nothing accepted at depth 1
    assert chooser.choose([2] * 4) == Cut(1, 1)
    # The other way round: a tree not yet drafted borrows from its chain.
    chooser = shapes_chooser(0.05, 1.0, 0.05, hazards=(0.7, 0.91))
    chain, tree = chooser.shapes[0].acceptance, chooser.shapes[1].acceptance
    chain.observe([2] * 400, [1] * 400, [0] * 200 + [1] * 200)  # depth 1 only: h_1 = 0.5
    chooser.rates([2])
    assert tree.hazards()[2] == pytest.approx([1.0 - (1.0 - chain.hazards()[2, 0]) ** 2, 0.91, 0.91])


def test_estimates_stay_finite_after_long_serving():
    """Forgetting decays the counts of depths and bands no longer seen; after
    enough steps (0.995^n underflows near n = 150 000; here memory 0.5) they
    would be 0 / 0. They return to the prior instead; what is seen is estimated."""
    model = AcceptanceModel(3, prior_hazard=0.7, memory=0.5)
    for _ in range(1200):
        model.observe([2], [1], [1])  # band 2, cut to depth 1, accepted
    hazards = model.hazards()
    assert np.isfinite(hazards).all()
    assert hazards[2, 0] == pytest.approx(1.0, abs=1e-5)
    assert hazards[:, 1:] == pytest.approx(np.full((4, 2), 0.7))
    assert hazards[[0, 1, 3], 0] == pytest.approx([0.7] * 3)


def test_expected_observations_count_like_the_trees_they_estimate():
    """``observe_survival``: 0/1 survivals are the trees' own observations; fractional
    ones are counted as expected observations (at risk S_(j-1), passed S_j)."""
    cut, accepted = np.array([3, 3, 2, 1]), np.array([0, 2, 2, 1])
    survival = (accepted[:, None] >= np.arange(1, 4)).astype(float)
    real, expected = AcceptanceModel(3), AcceptanceModel(3)
    real.observe([2] * 4, cut, accepted)
    expected.observe_survival([2] * 4, cut, survival)
    assert expected.hazards() == pytest.approx(real.hazards())
    soft = AcceptanceModel(3, prior_weight=0.0)
    soft.observe_survival([1, 1], [3, 2], [[0.5, 0.25, 0.1], [1.0, 0.5, 0.5]])  # depth 3 of the second: cut
    # (abs: the prior's weight floor, MIN_PRIOR_WEIGHT)
    assert soft.hazards()[1] == pytest.approx([1.5 / 2, 0.75 / 1.5, 0.1 / 0.25], abs=1e-5)
    narrow = AcceptanceModel(3, prior_weight=0.0)
    narrow.observe_survival([1], [2], [[0.5, 0.25]])  # fewer columns than depths: the rest uninformed
    assert narrow.reached[1] == pytest.approx([1.0, 0.5, 0.0])


def test_the_chain_learns_from_the_wider_trees_verified(monkeypatch):
    """While a wider shape runs, what its trees say about the chain feeds the
    chain's acceptance (not the tree's, nor with fixed hazards)."""
    import json
    from types import SimpleNamespace

    from vllm_univer.integration.tree_sizer import FIXED_HAZARDS_ENV, TreeSizer

    runner = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1), device="cpu")
    shapes = TreeSpec.parse("2x3").width_cuts()
    sizer = TreeSizer(runner, shapes, drafter=None)
    assert sizer.estimates_chain(shapes[1]) and not sizer.estimates_chain(shapes[0])
    assert not sizer.estimates_chain(TreeSpec.parse("3x3"))  # not a shape of this sizer
    tree_before = sizer.acceptance[1].hazards().copy()
    sizer.observe_chain(np.array([1.0, 0.0]), [3, 3], [[0.9, 0.6, 0.3], [1.0, 1.0, 0.0]])
    chain = sizer.acceptance[0]
    assert chain.reached[2] == pytest.approx([1.0, 0.9, 0.6]) and chain.accepted[2] == pytest.approx([0.9, 0.6, 0.3])
    assert chain.reached[0] == pytest.approx([1.0, 1.0, 1.0]) and chain.accepted[0] == pytest.approx([1.0, 1.0, 0.0])
    assert np.array_equal(sizer.acceptance[1].hazards(), tree_before)
    assert not TreeSizer(runner, shapes[:1], drafter=None).estimates_chain(shapes[0])  # the chain alone
    monkeypatch.setenv(FIXED_HAZARDS_ENV, json.dumps({"1": [0.7] * 3, "2": [0.9] * 3}))
    assert not TreeSizer(runner, shapes, drafter=None).estimates_chain(shapes[1])


def test_a_depth_seen_little_starts_from_the_depth_above():
    """With the shape's children per node, an unseen depth's prior is the depth
    above's estimate through the per-child model, not the flat prior: a chain seen
    accepting everything to depth 2 is valued so at depths 3 and 4 too."""
    chain = AcceptanceModel(4, prior_hazard=0.7, children=[1, 1, 1, 1])
    flat = AcceptanceModel(4, prior_hazard=0.7)
    for model in (chain, flat):
        model.observe([2] * 400, [2] * 400, [2] * 400)
    h = chain.hazards()[2]
    assert h[0] > 0.99 and h[2] == pytest.approx(h[1]) and h[3] == pytest.approx(h[1])
    assert flat.hazards()[2, 2:] == pytest.approx([0.7, 0.7])  # without children: the flat prior
    assert chain.hazards()[0] == pytest.approx([0.7] * 4)  # a band with nothing seen: the prior throughout
    # A change of width: two children per node at depth 1, one below: the same per-child acceptance.
    fork = AcceptanceModel(3, prior_hazard=[0.91, 0.7, 0.7], children=[2, 1, 1])
    fork.observe([2] * 400, [1] * 400, [1] * 396 + [0] * 4)
    h1 = fork.hazards()[2, 0]
    assert fork.hazards()[2, 1] == pytest.approx(1 - np.sqrt(1 - h1)) and 1 - np.sqrt(1 - h1) > 0.7
    # Never below the shape's own prior: a low estimate above leaves the unseen depths at it.
    low = AcceptanceModel(3, prior_hazard=0.7, children=[1, 1, 1])
    low.observe([2] * 400, [1] * 400, [1] * 100 + [0] * 300)
    assert low.hazards()[2, 0] < 0.3 and low.hazards()[2, 1:] == pytest.approx([0.7, 0.7])
    # A prior borrowed from another shape wins over the depth above.
    borrowed = np.zeros((4, 3), dtype=bool)
    borrowed[2, 2] = True
    prior = np.tile([0.91, 0.7, 0.7], (4, 1))
    prior[2, 2] = 0.2
    fork.set_prior(prior, borrowed)
    assert fork.hazards()[2, 2] == pytest.approx(0.2) and fork.hazards()[2, 1] == pytest.approx(1 - np.sqrt(1 - h1))


def test_a_catch_up_or_a_prefill_is_not_a_decode_step():
    flat = ForwardCost([1, 100], [1.0, 1.0])
    cost = StepCostModel(flat, flat, WIDTHS_2X3)
    assert cost.is_decode_step(cost.work(4, 2), 4, 2) and cost.is_decode_step(StepWork(12, [8, 8]), 4, 2)
    assert not cost.is_decode_step(StepWork(12, [9, 8]), 4, 2)  # the draft ran tokens of plain steps
    assert not cost.is_decode_step(StepWork(40, [4, 8]), 4, 2)  # a prompt joined the target's step
    assert cost.is_decode_step(StepWork(4), 4, 0) and not cost.is_decode_step(StepWork(5), 4, 0)


def test_a_cut_run_again_after_a_gap_restarts_its_window():
    """A speculating cut's ratios from before more than a window of other steps
    describe another spell: its next step replaces them (plain steps keep theirs)."""
    flat = ForwardCost([1, 100], [1.0, 1.0])
    cost = StepCostModel(flat, flat, WIDTHS_2X3, window=5)
    for _ in range(5):
        cost.observe(2, cost.work(1, 2), 9.0)  # a slow spell: 3 x the 3 s predicted
        cost.observe(0, cost.work(1, 0), 1.0)
    cost.observe(2, cost.work(1, 2), 3.0)  # right after: one step among the window's
    assert cost.factor(2) == 3.0
    for _ in range(6):
        cost.observe(0, cost.work(1, 0), 1.5)
    assert cost.factor(0) == 1.5 and cost.factor(2) == 3.0  # not run since: the old ratios still stand
    cost.observe(2, cost.work(1, 2), 3.3)
    assert cost.factor(2) == pytest.approx(1.1)  # run again after 6 other steps: a new window
    assert cost.floor_seconds(1, 2) == pytest.approx(3 * 1.5)  # its forwards at the plain correction
