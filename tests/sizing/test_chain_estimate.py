"""The chain's acceptance read off a wider verified tree (``sizing.chain_estimate``):
unbiased, checked exactly (float64, every tree of the scheme enumerated on a tiny
vocabulary), and exact for greedy rows."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from vllm_univer import TreeSpec, verify_greedy
from vllm_univer.sizing.chain_estimate import chain_survival, greedy_chain_survival
from vllm_univer.tools.law_oracle import PathModel, batch_tensors, enumerate_trees, top_set

pytestmark = pytest.mark.quick

TREES = {
    "2x2": "2x2",
    "2x3": "2x3",
    "3x2": "3x2",
    # every node above the last level has children, one to three of them
    "irregular": [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (2, 0), (2, 1), (2, 2)],
    "forked-chains": [(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (1, 0, 0)],
}


def _draws(scheme: str, vocab: int, m: int) -> int:
    """Children outcomes of one node (an upper bound: zeros in q remove some)."""
    return {"topk1": vocab - m + 1, "wor": math.perm(vocab, m), "iid": vocab**m}[scheme]


def _cases(max_trees: int = 20_000):
    """(scheme, tree, vocab) whose enumeration stays under ``max_trees`` trees."""
    for scheme, name, vocab in itertools.product(["topk1", "wor", "iid"], TREES, [3, 4, 5]):
        tree = TreeSpec.parse(TREES[name])
        if math.prod(_draws(scheme, vocab, m) for m in tree.num_children.tolist() if m) <= max_trees:
            yield scheme, name, vocab


def chain_token_survival(target: PathModel, draft: PathModel, depth: int) -> np.ndarray:
    """[D] P(A >= j) of a chain drafted from ``draft`` and verified token by token
    against ``target``: the sum over token strings of prod_i min(p_i(x_i), q_i(x_i))."""
    out = np.zeros(depth)
    for j in range(1, depth + 1):
        for s in itertools.product(range(target.vocab), repeat=j):
            out[j - 1] += np.prod([min(target(s[:i])[s[i]], draft(s[:i])[s[i]]) for i in range(j)])
    return out


CASES = list(_cases())


def test_every_scheme_is_checked_beyond_depth_two():
    for scheme in ("topk1", "wor", "iid"):
        assert any(s == scheme and TreeSpec.parse(TREES[n]).max_depth >= 3 for s, n, _ in CASES), scheme


@pytest.mark.parametrize("scheme,name,vocab", CASES)
def test_expectation_over_trees_is_the_chains_survival(scheme, name, vocab):
    tree = TreeSpec.parse(TREES[name])
    target = PathModel(vocab, vocab)
    draft = PathModel(vocab, vocab + 100, base=target)
    trees = enumerate_trees(scheme, tree, draft)
    probs = torch.tensor([pr for pr, _ in trees], dtype=torch.float64)
    tokens, p, q = batch_tensors(tree, [t for _, t in trees], target, draft)
    survival = chain_survival(tree, scheme, tokens, p, q)
    assert survival.dtype == torch.float64 and survival.shape == (len(trees), tree.max_depth)
    expected = (probs.unsqueeze(1) * survival).sum(0).numpy()
    exact = chain_token_survival(target, draft, tree.max_depth)
    np.testing.assert_allclose(expected, exact, rtol=0, atol=1e-12)
    assert (survival >= 0).all()


def test_a_node_without_children_leaves_its_mass_out():
    """Below a leaf the chain could go on and the tree cannot tell: the estimate
    is a lower bound there (the sizer's trees are full: its width cuts)."""
    tree = TreeSpec.parse([(0,), (1,), (0, 0)])  # node (1,) is a leaf at depth 1
    target = PathModel(3, 7, zeros=False)
    draft = PathModel(3, 8, base=target, zeros=False)
    trees = enumerate_trees("topk1", tree, draft)
    probs = torch.tensor([pr for pr, _ in trees], dtype=torch.float64)
    tokens, p, q = batch_tensors(tree, [t for _, t in trees], target, draft)
    expected = (probs.unsqueeze(1) * chain_survival(tree, "topk1", tokens, p, q)).sum(0).numpy()
    exact = chain_token_survival(target, draft, 2)
    assert abs(expected[0] - exact[0]) < 1e-12
    assert expected[1] < exact[1] - 1e-6


@pytest.mark.parametrize("name", list(TREES))
def test_greedy_rows_count_the_argmax_chain_exactly(name):
    tree = TreeSpec.parse(TREES[name])
    children = tree.children.tolist()
    mismatches = 0
    for seed in range(40):
        target, draft = PathModel(4, seed, zeros=False), PathModel(4, seed + 50, zeros=False)
        # As the drafter drafts greedy rows: the top tokens of q in rank order.
        tokens, paths = [-1] * (tree.num_nodes + 1), {0: ()}
        for v in range(tree.num_nodes + 1):
            kids = [c for c in children[v] if c >= 0]
            for c, x in zip(kids, top_set(draft(paths[v]), len(kids))):
                tokens[c], paths[c] = x, paths[v] + (x,)
        argmax = [int(np.argmax(target(paths[v]))) for v in range(tree.num_nodes + 1)]
        end = verify_greedy(tree, torch.tensor([tokens]), torch.tensor([argmax])).end_node
        got = greedy_chain_survival(tree, tree.ancestors[end]).squeeze(0).tolist()
        # The argmax chain of the draft, accepted while the target's argmax agrees.
        want, prefix = [], ()
        for _ in range(tree.max_depth):
            x = int(np.argmax(draft(prefix)))
            want.append(1.0 if (not want or want[-1]) and x == int(np.argmax(target(prefix))) else 0.0)
            prefix += (x,)
        assert got == want, (seed, tokens, argmax)
        mismatches += want[0] == 0.0
    assert 0 < mismatches < 40  # both outcomes occur


def test_sampled_estimate_is_batched_and_float32_in_the_engine_dtype():
    tree = TreeSpec.parse("2x5")
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, tree.num_nodes + 1, 50, generator=gen), -1)
    q = torch.softmax(torch.randn(3, tree.num_nodes + 1, 50, generator=gen), -1)
    tokens = torch.randint(0, 50, (3, tree.num_nodes + 1), generator=gen)
    tokens[2, 7:] = -1  # a request whose tree was cut after depth 2
    both = chain_survival(tree, "topk1", tokens, p, q)
    assert both.dtype == torch.float32 and both.shape == (3, 5)
    alone = chain_survival(tree, "topk1", tokens[2:], p[2:], q[2:])
    assert torch.equal(both[2:], alone)
    assert (both[2, 2:] == 0).all()
    # A node's children weigh at most 1 together (the top slots' q mass, plus the rest's).
    assert (both[:, 1:] <= both[:, :-1] + 1e-6).all() and (both <= 1 + 1e-6).all()
