"""Bad input gets a ValueError that says what is wrong."""

import pytest
import torch

from vllm_univer import TreeSpec, outcome_law, verify

pytestmark = pytest.mark.quick


def _inputs(tree, batch=2, vocab=5):
    tokens = torch.randint(0, vocab, (batch, tree.num_nodes + 1))
    p = torch.full((batch, tree.num_nodes + 1, vocab), 1.0 / vocab)
    return tokens, p, p.clone()


def test_unknown_method():
    tree = TreeSpec.parse("2x2")
    with pytest.raises(ValueError, match="unknown verifier 'medusa'.*univer"):
        verify("medusa", tree, *_inputs(tree))


@pytest.mark.parametrize("method", ["token", "block"])
def test_chain_methods_refuse_trees(method):
    tree = TreeSpec.parse("2x2")
    with pytest.raises(ValueError, match="single chain"):
        verify(method, tree, *_inputs(tree))
    with pytest.raises(ValueError, match="single chain"):
        outcome_law(method, tree, *_inputs(tree))


def test_shape_mismatches():
    tree = TreeSpec.parse("2x2")
    tokens, p, q = _inputs(tree)
    with pytest.raises(ValueError, match=r"draft_token_ids must be \[B, N\+1\]"):
        verify("univer", tree, tokens[:, :-1], p, q)
    with pytest.raises(ValueError, match="target_probs must be"):
        verify("univer", tree, tokens, p[:1], q)
    with pytest.raises(ValueError, match="vocabularies must match"):
        verify("univer", tree, tokens, p, q[..., :4])
    with pytest.raises(ValueError, match="integer tensor"):
        verify("univer", tree, tokens.float(), p, q)
    with pytest.raises(ValueError, match="greedy must be"):
        verify("univer", tree, tokens, p, q, greedy=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="TreeSpec"):
        verify("univer", "2x2", tokens, p, q)


@pytest.mark.parametrize(
    "bad,match",
    [
        (float("nan"), "NaN or inf"),
        (float("inf"), "NaN or inf"),
        (-0.1, "non-negative"),
        (0.5, "sum to 1"),
    ],
)
@pytest.mark.parametrize("which", ["target", "draft"])
def test_bad_probabilities(bad, match, which):
    tree = TreeSpec.parse("2x2")
    tokens, p, q = _inputs(tree)
    rows = p if which == "target" else q
    if bad < 0:
        rows[1, 0, 1] += rows[1, 0, 0] - bad  # keep the sum at 1: only the sign is wrong
        rows[1, 0, 0] = bad
    else:
        rows[1, 0, 0] += bad  # node 0 has children, so both of its rows are read
    with pytest.raises(ValueError, match=match):
        verify("univer", tree, tokens, p, q)


def test_rows_of_missing_nodes_and_leaf_draft_rows_are_not_read():
    tree = TreeSpec.parse("2x2")
    tokens, p, q = _inputs(tree)
    tokens[:, 2] = -1
    tokens[:, 5:7] = -1  # children of node 2
    p[:, 2] = float("nan")
    q[:, 2] = float("nan")
    q[:, 3:] = 0.0  # leaf draft rows are ignored
    for method in ("univer", "traversal", "rrsw", "greedy", "target_only", "rrs"):
        out = verify(method, tree, tokens, p, q)
        assert (out.end_node != 2).all()
        law = outcome_law(method, tree, tokens, p, q)
        assert torch.isfinite(law).all() and law[:, 2].sum() == 0


def test_bad_tokens():
    tree = TreeSpec.parse("2x2")
    tokens, p, q = _inputs(tree)
    bad = tokens.clone()
    bad[0, 3] = 5
    with pytest.raises(ValueError, match=r"lie in \[0, 5\)"):
        verify("univer", tree, bad, p, q)
    orphan = tokens.clone()
    orphan[0, 1] = -1  # node 3, 4 still hold tokens
    with pytest.raises(ValueError, match="parent is missing"):
        verify("univer", tree, orphan, p, q)
