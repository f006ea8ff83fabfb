"""Temperature-0 requests: argmax semantics for every method, with and without the
``greedy`` flag, no NaN even when p is one-hot and q has zeros."""

import pytest
import torch

from vllm_univer import METHODS, TreeSpec, outcome_law, scheme_for, verify, verify_greedy
from vllm_univer.tools.law_oracle import PathModel, batch_tensors, enumerate_trees

pytestmark = pytest.mark.quick


def _argmax_walk(tree, tokens, p):
    """Reference: descend into the first child holding argmax p, else Y = argmax p."""
    out = []
    children = tree.children.tolist()
    for b in range(tokens.shape[0]):
        node, path = 0, []
        while True:
            best = int(p[b, node].argmax())
            nxt = next((c for c in children[node] if c >= 0 and tokens[b, c] == best), None)
            if nxt is None:
                out.append(path + [best] + [-1] * (tree.max_depth - len(path)))
                break
            path.append(best)
            node = nxt
    return torch.tensor(out)


def _trees(method, onehot_target, seed):
    vocab = 4
    tree = TreeSpec.parse("1x3") if method in ("token", "block") else TreeSpec.parse("2x2")
    target = PathModel(vocab, seed=seed, onehot=onehot_target)
    # A draft with zeros and the target's argmax often on top.
    draft = PathModel(vocab, seed=seed + 1, base=PathModel(vocab, seed=seed), zeros=True)
    trees = enumerate_trees(scheme_for(method), tree, draft)
    tokens, p, q = batch_tensors(tree, [t for _, t in trees], target, draft, dtype=torch.float32)
    return tree, tokens, p, q


@pytest.mark.parametrize("method", METHODS)
def test_greedy_flag_is_argmax_matching(method):
    tree, tokens, p, q = _trees(method, onehot_target=False, seed=3)
    greedy = torch.ones(tokens.shape[0], dtype=torch.bool)
    out = verify(method, tree, tokens, p, q, generator=torch.Generator().manual_seed(0), greedy=greedy)
    assert torch.equal(out.output_token_ids, _argmax_walk(tree, tokens, p))
    # The engine's all-greedy path: the same from the argmax alone.
    fast = verify_greedy(tree, tokens, p.argmax(-1))
    assert torch.equal(fast.output_token_ids, out.output_token_ids)
    assert torch.equal(fast.end_node, out.end_node) and torch.equal(fast.num_accepted, out.num_accepted)


@pytest.mark.parametrize("method", METHODS)
def test_one_hot_target_gives_argmax_path_without_flag(method):
    """With p one-hot, losslessness forces the argmax path; the method's own rule must
    get there with no NaN from 0/0 (q has zeros)."""
    tree, tokens, p, q = _trees(method, onehot_target=True, seed=5)
    for seed in range(3):
        out = verify(method, tree, tokens, p, q, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(out.output_token_ids, _argmax_walk(tree, tokens, p))
    law = outcome_law(method, tree, tokens, p, q)
    assert torch.isfinite(law).all()
    assert torch.allclose(law.sum((1, 2)), torch.ones(law.shape[0], dtype=law.dtype))


@pytest.mark.parametrize("method", ["univer", "traversal", "rrs", "target_only"])
def test_mixed_greedy_and_sampled_rows(method):
    """Greedy rows are argmax; sampled rows in the same batch keep their own law."""
    tree, tokens, p, q = _trees(method, onehot_target=False, seed=9)
    batch = tokens.shape[0]
    greedy = torch.arange(batch) % 2 == 0
    gen = torch.Generator().manual_seed(1)
    out = verify(method, tree, tokens, p, q, generator=gen, greedy=greedy)
    assert torch.equal(out.output_token_ids[greedy], _argmax_walk(tree, tokens, p)[greedy])
    # Sampled rows only produce outcomes of positive exact probability.
    law = outcome_law(method, tree, tokens, p, q)
    rows = torch.nonzero(~greedy).flatten()
    y = out.output_token_ids[rows, out.num_accepted[rows]]
    assert (law[rows, out.end_node[rows], y] > 0).all()


IRREGULAR = [(0,), (1,), (2,), (0, 0), (0, 1), (2, 0), (0, 0, 0), (0, 1, 0), (0, 1, 1), (2, 0, 0), (0, 1, 1, 0)]


@pytest.mark.parametrize("shape", ["3x3", "1x4", "2x4", IRREGULAR])
def test_argmax_matching_walks_the_first_matching_child_at_every_depth(shape):
    """``verify_greedy`` against the walk itself on deeper and irregular trees, with
    duplicate siblings (a 3-token vocabulary: several children often hold the argmax;
    the walk takes the first), missing subtrees and ends at every depth."""
    tree = TreeSpec.parse(shape)
    gen = torch.Generator().manual_seed(1)
    batch, n1 = 600, tree.num_nodes + 1
    tokens = torch.randint(0, 3, (batch, n1), generator=gen)
    tokens[torch.rand(batch, n1, generator=gen) < 0.1] = -1
    for node, parent in enumerate(tree.parent.tolist()):  # a missing node's subtree is missing
        if parent >= 0:
            tokens[:, node] = tokens[:, node].masked_fill(tokens[:, parent] < 0, -1)
    tokens[:, 0] = 0
    argmax = torch.randint(0, 3, (batch, n1), generator=gen)
    out = verify_greedy(tree, tokens, argmax)
    expected = _argmax_walk(tree, tokens, torch.nn.functional.one_hot(argmax, 3).float())
    assert torch.equal(out.output_token_ids, expected)
    assert torch.equal(out.num_accepted, (expected >= 0).sum(1) - 1)
    assert set(out.num_accepted.tolist()) == set(range(tree.max_depth + 1))  # every depth reached
