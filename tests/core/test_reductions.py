"""Reductions between verifiers and orderings of their expected acceptance (exact, float64)."""

import numpy as np
import pytest
import torch

from vllm_univer import TreeSpec, outcome_law
from vllm_univer.tools.law_oracle import PathModel, batch_tensors, enumerate_trees, expected_accepted

SEEDS = [0, 1, 2, 3]


def _laws_on_same_trees(methods, scheme, tree, target, draft):
    trees = enumerate_trees(scheme, tree, draft)
    tokens, p, q = batch_tensors(tree, [t for _, t in trees], target, draft)
    return [outcome_law(m, tree, tokens, p, q) for m in methods]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("depth,vocab", [(1, 6), (2, 5), (3, 4)])
def test_univer_with_one_child_is_block(seed, depth, vocab):
    """m = 1 everywhere: topk1 draws one sample from q (the chain scheme) and UniVer is Block Verification."""
    tree = TreeSpec.parse(f"1x{depth}")
    target, draft = PathModel(vocab, 10 + seed), PathModel(vocab, 20 + seed, base=PathModel(vocab, 10 + seed))
    univer, block = _laws_on_same_trees(["univer", "block"], "chain", tree, target, draft)
    assert torch.allclose(univer, block, atol=1e-13, rtol=0)
    assert expected_accepted("univer", "topk1", tree, target, draft) == pytest.approx(
        expected_accepted("block", "chain", tree, target, draft), abs=1e-13
    )


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("depth,vocab", [(1, 6), (2, 5), (3, 4)])
def test_univer_wor_with_one_child_is_block(seed, depth, vocab):
    """m = 1 everywhere: a wor child is one sample from q, and univer_wor is Block Verification."""
    tree = TreeSpec.parse(f"1x{depth}")
    target, draft = PathModel(vocab, 50 + seed), PathModel(vocab, 60 + seed, base=PathModel(vocab, 50 + seed))
    univer_wor, block = _laws_on_same_trees(["univer_wor", "block"], "chain", tree, target, draft)
    assert torch.allclose(univer_wor, block, atol=1e-13, rtol=0)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("vocab", [4, 6])
def test_univer_wor_at_depth_one_passes_on_at_least_rrsws_mass(seed, vocab):
    """Depth 1, two wor children: each node takes the better of two couplings, one of
    which dominates RRSw's second step, so E[accepted] >= rrsw's (= traversal's)."""
    tree = TreeSpec.parse("2x1")
    for base in (None, PathModel(vocab, 70 + seed)):
        target = base or PathModel(vocab, 70 + seed)
        draft = PathModel(vocab, 80 + seed, base=base)
        new = expected_accepted("univer_wor", "wor", tree, target, draft)
        assert new >= expected_accepted("rrsw", "wor", tree, target, draft) - 1e-12


def test_univer_wor_beats_traversal_on_average():
    """Exact E[accepted] on wor trees (2x2, V = 4), smooth and mixed drafts: clearly
    above Traversal Verification on average, and never far below it on one model
    (measured worst: -6e-6 on a 3x1 tree, see benchmarks/results/lp_optimum.md)."""
    tree = TreeSpec.parse("2x2")
    gains = []
    for seed in range(6):
        for mixed in (False, True):
            target = PathModel(4, 900 + seed)
            draft = PathModel(4, 950 + seed, base=target if mixed else None)
            gain = expected_accepted("univer_wor", "wor", tree, target, draft) - expected_accepted(
                "traversal", "wor", tree, target, draft
            )
            assert gain > -1e-4, (seed, mixed, gain)
            gains.append(gain)
    assert np.mean(gains) > 0.03, gains


def _smooth_or_mixed(vocab: int, target_seed: int, draft_seed: int, mixed: bool):
    """A target and a draft: smooth and independent, or with zeros and ties, the
    draft mixed with the target."""
    target = PathModel(vocab, target_seed, zeros=mixed, ties=mixed)
    if mixed:
        return target, PathModel(vocab, draft_seed, base=target)
    return target, PathModel(vocab, draft_seed, zeros=False, ties=False)


def test_univer_wor_three_children_reach_the_one_step_optimum_closely():
    """Depth 1, three wor children: x3 may go first (``_FirstOfThree``). Exact, V = 5,
    smooth and mixed drafts: per model at least traversal (= RRSw here), and in
    total clearly more: measured +4.7 %, where the pair-then-lone construction it
    replaces got +2.6 % (its ceiling: ``benchmarks/results/wor_stage_bound.md``)."""
    tree = TreeSpec.parse("3x1")
    new_total = old_total = 0.0
    for seed in range(6):
        for mixed in (False, True):
            target, draft = _smooth_or_mixed(5, 300 + seed, 350 + seed, mixed)
            new = expected_accepted("univer_wor", "wor", tree, target, draft)
            old = expected_accepted("traversal", "wor", tree, target, draft)
            assert new >= old - 1e-12, (seed, mixed)
            new_total, old_total = new_total + new, old_total + old
    assert new_total > 1.04 * old_total, (new_total, old_total)


def test_univer_wor_cut_children_leave_the_whole_demand():
    """A node whose three child slots the step cut (tokens -1, the shape's sizes kept:
    tree "auto" cuts, the last tokens of max_tokens) ends there with Y ~ P~ p: the
    triple's marginals assume a drawn third child and must not be used."""
    from vllm_univer.core.verifiers.base import NodeBatch
    from vllm_univer.core.verifiers.univer_wor import UniVerWorVerifier

    gen = torch.Generator().manual_seed(0)
    p = torch.rand(2, 1, 7, generator=gen, dtype=torch.float64)
    q = torch.rand(2, 1, 7, generator=gen, dtype=torch.float64)
    p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
    tokens = torch.tensor([[[-1, -1, -1]], [[3, -1, -1]]])
    scale = torch.tensor([[0.6], [0.6]], dtype=torch.float64)
    out = UniVerWorVerifier().node_rule(NodeBatch(p, q, tokens, scale, torch.ones(1, 3, dtype=torch.long)), True)
    torch.testing.assert_close(out.residual[0], 0.6 * p[0], rtol=0, atol=1e-15)
    assert out.child_weights[0].abs().max() == 0
    # One child left: Block Verification's step, min(1, P~ p / q) at token 3.
    expected = torch.clamp(0.6 * p[1, 0, 3] / q[1, 0, 3], max=1.0)
    torch.testing.assert_close(out.child_weights[1, 0, 0], expected, rtol=0, atol=1e-15)
    left = 0.6 * p[1, 0] - torch.minimum(q[1, 0], 0.6 * p[1, 0])
    residual = out.residual[1, 0]
    torch.testing.assert_close(residual / residual.sum(), left / left.sum(), rtol=0, atol=1e-15)


@pytest.mark.parametrize(
    "paths",
    [
        [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)],  # slot 0 carries the deeper subtree
        [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)],  # EAGLE-like: fewer children off rank 0
    ],
)
def test_univer_wor_keeps_up_with_traversal_on_irregular_trees(paths):
    """Where a pair's slots carry subtrees of different sizes, univer_wor weighs what
    each coupling passes to each slot by sqrt(subtree size), and its selection by
    ratio favours the larger subtree (ratios floored at the weights' ratio, ties to
    the larger). Unweighted, its one-step choice often selected the shallow slot
    first and fell 1-21 % below traversal there (below RRSw too on mixed drafts);
    weighted, with the plain selection (2026-12-02 .. 12-05), +0.71 % / +0.91 % in
    total but down to -1.35e-2 per model. Exact, V = 4, smooth and mixed drafts:
    now at least traversal (and RRSw) on every model, and in total +2.85 % /
    +2.34 % above traversal."""
    tree = TreeSpec.from_paths(paths)
    new_total = old_total = 0.0
    for seed in range(4):
        for mixed in (False, True):
            target, draft = _smooth_or_mixed(4, 1000 + seed, 2000 + seed, mixed)
            new = expected_accepted("univer_wor", "wor", tree, target, draft)
            old = expected_accepted("traversal", "wor", tree, target, draft)
            assert new >= expected_accepted("rrsw", "wor", tree, target, draft) - 1e-12
            assert new >= old - 1e-12, (seed, mixed)
            new_total, old_total = new_total + new, old_total + old
    assert new_total > 1.02 * old_total, (new_total, old_total)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("depth,vocab", [(1, 6), (3, 4)])
def test_greedy_with_one_child_is_token(seed, depth, vocab):
    tree = TreeSpec.parse(f"1x{depth}")
    target, draft = PathModel(vocab, 30 + seed), PathModel(vocab, 40 + seed)
    greedy, token = _laws_on_same_trees(["greedy", "token"], "chain", tree, target, draft)
    assert torch.allclose(greedy, token, atol=1e-13, rtol=0)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("depth,vocab", [(2, 5), (3, 4)])
def test_traversal_on_a_chain_is_block(seed, depth, vocab):
    tree = TreeSpec.parse(f"1x{depth}")
    target, draft = PathModel(vocab, 50 + seed), PathModel(vocab, 60 + seed)
    traversal, block = _laws_on_same_trees(["traversal", "block"], "chain", tree, target, draft)
    assert torch.allclose(traversal, block, atol=1e-13, rtol=0)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("width,vocab", [(2, 5), (3, 5)])
def test_traversal_at_depth_one_is_rrsw(seed, width, vocab):
    tree = TreeSpec.parse(f"{width}x1")
    target, draft = PathModel(vocab, 70 + seed), PathModel(vocab, 80 + seed)
    traversal, rrsw = _laws_on_same_trees(["traversal", "rrsw"], "wor", tree, target, draft)
    assert torch.allclose(traversal, rrsw, atol=1e-13, rtol=0)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("width,vocab", [(2, 5), (3, 6)])
def test_univer_at_depth_one_matches_greedy_acceptance(seed, width, vocab):
    """Same E[accepted] for every single tree, not only on average."""
    tree = TreeSpec.parse(f"{width}x1")
    target, draft = PathModel(vocab, 90 + seed), PathModel(vocab, 95 + seed)
    univer, greedy = _laws_on_same_trees(["univer", "greedy"], "topk1", tree, target, draft)
    depth = tree.depth.double()
    assert torch.allclose((univer.sum(-1) * depth).sum(-1), (greedy.sum(-1) * depth).sum(-1), atol=1e-13, rtol=0)


@pytest.mark.parametrize("seed", range(6))
def test_block_accepts_at_least_as_much_as_token(seed):
    tree, vocab = TreeSpec.parse("1x3"), 4
    target, draft = PathModel(vocab, 110 + seed), PathModel(vocab, 120 + seed)
    block = expected_accepted("block", "chain", tree, target, draft)
    token = expected_accepted("token", "chain", tree, target, draft)
    assert block >= token - 1e-12


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("shape,vocab", [("2x2", 4), ("2x3", 4), ("3x2", 5)])
def test_univer_accepts_at_least_as_much_as_greedy(seed, shape, vocab):
    tree = TreeSpec.parse(shape)
    target = PathModel(vocab, 130 + seed)
    draft = PathModel(vocab, 140 + seed, base=target)
    univer = expected_accepted("univer", "topk1", tree, target, draft)
    greedy = expected_accepted("greedy", "topk1", tree, target, draft)
    assert univer >= greedy - 1e-12


def test_orderings_are_strict_on_average():
    """Over many random models the gains are real, not only ties (guards against a
    verifier that silently degenerates into its baseline)."""
    gains = {"block-token": [], "univer-greedy": [], "traversal-rrsw": []}
    for seed in range(8):
        target = PathModel(4, 300 + seed)
        draft = PathModel(4, 400 + seed, base=target)
        chain, tree, wtree = TreeSpec.parse("1x3"), TreeSpec.parse("2x3"), TreeSpec.parse("2x2")
        gains["block-token"].append(
            expected_accepted("block", "chain", chain, target, draft)
            - expected_accepted("token", "chain", chain, target, draft)
        )
        gains["univer-greedy"].append(
            expected_accepted("univer", "topk1", tree, target, draft)
            - expected_accepted("greedy", "topk1", tree, target, draft)
        )
        gains["traversal-rrsw"].append(
            expected_accepted("traversal", "wor", wtree, target, draft)
            - expected_accepted("rrsw", "wor", wtree, target, draft)
        )
    for name, g in gains.items():
        assert np.mean(g) > 1e-3, (name, g)
