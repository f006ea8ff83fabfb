"""The sampling code that runs (``verify``) against the exact law (``outcome_law``):
seeded chi-square goodness of fit over many draws, batched, float32 and float64."""

import numpy as np
import pytest
import torch

from vllm_univer import METHODS, TreeSpec, draft_children, outcome_law, scheme_for, verify
from vllm_univer.tools.goodness_of_fit import chi_square_pvalue
from vllm_univer.tools.law_oracle import PathModel, batch_tensors, enumerate_trees

IRREGULAR = TreeSpec.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1)])


def _tree_for(method):
    return TreeSpec.parse("1x3") if method in ("token", "block") else IRREGULAR


def _distinct_trees(method, tree, target, draft, count, seed):
    """``count`` trees drawn from the method's own scheme (different contents per row)."""
    trees = enumerate_trees(scheme_for(method), tree, draft)
    rng = np.random.default_rng(seed)
    probs = np.array([p for p, _ in trees])
    picks = rng.choice(len(trees), size=count, replace=False, p=probs) if len(trees) > count else range(len(trees))
    return [trees[i][1] for i in picks]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("method", METHODS)
def test_verify_matches_outcome_law(method, dtype):
    vocab, draws_per_tree = 5, 6000
    tree = _tree_for(method)
    target = PathModel(vocab, seed=1)
    draft = PathModel(vocab, seed=2, base=target)
    token_lists = _distinct_trees(method, tree, target, draft, count=4, seed=3)
    tokens, p, q = batch_tensors(tree, token_lists, target, draft, dtype=dtype)
    law = outcome_law(method, tree, tokens, p, q).numpy()  # [T, N+1, V]

    def reps(t):
        return t.repeat_interleave(draws_per_tree, 0)

    gen = torch.Generator().manual_seed(1234)
    out = verify(method, tree, reps(tokens), reps(p), reps(q), generator=gen)

    # Check the output layout against the end node before counting.
    depth = tree.depth[out.end_node]
    assert torch.equal(out.num_accepted, depth)
    rows = torch.arange(len(depth))
    y = out.output_token_ids[rows, depth]
    assert (y >= 0).all() and (y < vocab).all()
    path = tree.ancestors[out.end_node]
    for k in range(tree.max_depth):
        on_path = path[:, k] >= 0
        expect = reps(tokens).gather(1, path[:, k : k + 1].clamp(min=0)).squeeze(1)
        assert torch.equal(out.output_token_ids[on_path, k], expect[on_path])
        assert (out.output_token_ids[~on_path & (depth < k), k + 1] == -1).all()

    which_tree = torch.arange(len(token_lists)).repeat_interleave(draws_per_tree)
    cells = (which_tree * law[0].size + out.end_node * vocab + y).numpy()
    counts = np.bincount(cells, minlength=law.size)
    assert counts[law.reshape(-1) == 0].sum() == 0, "an outcome with exact probability 0 was sampled"
    for t in range(len(token_lists)):
        block = slice(t * law[0].size, (t + 1) * law[0].size)
        pvalue = chi_square_pvalue(counts[block], law[t].reshape(-1))
        assert pvalue > 1e-4, f"tree {t}: p-value {pvalue:.2e}"


@pytest.mark.parametrize("method", ["univer", "traversal", "rrsw", "greedy"])
def test_verify_matches_exact_on_drafted_trees(method):
    """End to end through ``draft_children``: draft a tree per row with the package's
    drafter, verify, and compare the law of the first token with the target's."""
    vocab, rows = 6, 20000
    tree = TreeSpec.parse("2x2")
    target = PathModel(vocab, seed=5, zeros=False)
    draft = PathModel(vocab, seed=6, base=target, zeros=False)
    gen = torch.Generator().manual_seed(99)
    scheme = scheme_for(method)
    n1 = tree.num_nodes + 1
    tokens = torch.full((rows, n1), -1, dtype=torch.long)
    q = torch.zeros(rows, n1, vocab, dtype=torch.float64)
    p = torch.zeros_like(q)
    q[:, 0] = torch.tensor(draft(()))
    p[:, 0] = torch.tensor(target(()))
    for level in tree.internal_levels():
        for v in level.tolist():
            kids = [c for c in tree.children[v].tolist() if c >= 0]
            drawn = draft_children(scheme, q[:, v], len(kids), generator=gen)
            tokens[:, kids] = drawn
            for c in kids:
                # Rows of the child's prefix: the toy models are keyed by the path.
                for row in range(rows):
                    if tokens[row, c] >= 0:
                        path = tuple(tokens[row, a].item() for a in tree.ancestors[c].tolist() if a >= 0)
                        p[row, c] = torch.tensor(target(path))
                        q[row, c] = torch.tensor(draft(path))
    out = verify(method, tree, tokens, p, q, generator=gen)

    # Complete every output to D+1 tokens with target sampling; compare the law of
    # the strings with the target's own law over all V^(D+1) strings.
    length = tree.max_depth + 1
    rng = np.random.default_rng(7)
    cells = []
    for row in out.output_token_ids.tolist():
        s = [t for t in row if t >= 0]
        while len(s) < length:
            s.append(int(rng.choice(vocab, p=target(s))))
        cells.append(int(np.ravel_multi_index(s, (vocab,) * length)))
    counts = np.bincount(cells, minlength=vocab**length)
    exact = np.array([np.prod([target(s[:k])[s[k]] for k in range(length)]) for s in np.ndindex(*(vocab,) * length)])
    assert chi_square_pvalue(counts, exact) > 1e-4


@pytest.mark.parametrize("block", [1, 3, 4, 1024])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sample_from_weights_two_stage_law(block, dtype):
    """The two-stage inverse CDF draws w / sum(w) whatever the block size (full
    blocks, a short last block, blocks of zeros); zero weights are never drawn."""
    from vllm_univer.core.inverse_cdf import sample_from_weights

    gen = torch.Generator().manual_seed(block)
    weights = torch.tensor(
        [
            [0.0, 0.3, 0.0, 0.1, 0.25, 0.0, 0.0, 0.0, 0.35, 0.0],
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0],
            [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
        ],
        dtype=dtype,
    )
    draws = 40000
    idx = sample_from_weights(weights.repeat(draws, 1), gen, block=block).view(draws, 3)
    for row in range(3):
        counts = np.bincount(idx[:, row].numpy(), minlength=10)
        law = (weights[row] / weights[row].sum()).double().numpy()
        assert counts[law == 0].sum() == 0
        assert chi_square_pvalue(counts, law) > 1e-4, (row, counts)


@pytest.mark.parametrize("block", [1, 3, 4, 1024])
def test_block_cdf_draw_excluding_tokens_law(block):
    """Draws that exclude tokens (in one block, across blocks, repeated, -1) follow
    w / sum(w) over the other tokens; excluded tokens are never drawn; a row whose
    whole mass is excluded gives -1. Several draws share one ``BlockCdf``."""
    from vllm_univer.core.inverse_cdf import BlockCdf

    gen = torch.Generator().manual_seed(block)
    weights = torch.tensor(
        [
            [0.0, 0.3, 0.05, 0.1, 0.25, 0.0, 0.0, 0.0, 0.3, 0.0],
            [0.9, 1e-4, 2e-4, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
            [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
            [0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0],
        ],
        dtype=torch.float32,
    )
    exclude = torch.tensor([[1, 8, -1], [0, 0, -1], [9, 2, 3], [4, 5, -1]])
    draws = 40000
    cdf = BlockCdf(weights.repeat(draws, 1), block=block)
    for _ in range(2):
        idx = cdf.draw(gen, exclude=exclude.repeat(draws, 1)).view(draws, 4)
        assert (idx[:, 3] == -1).all()
        for row in range(3):
            law = weights[row].double().clone()
            law[exclude[row][exclude[row] >= 0]] = 0
            law /= law.sum()
            counts = np.bincount(idx[:, row].numpy(), minlength=10)
            assert counts[law.numpy() == 0].sum() == 0
            assert chi_square_pvalue(counts, law.numpy()) > 1e-4, (row, counts)


@pytest.mark.parametrize("block", [1, 3, 1024])
def test_block_cdf_total_excluding_tokens_has_no_cancellation(block):
    """``BlockCdf.total`` sums each block without the excluded tokens: in float32, a
    token holding 0.9999 of the mass leaves the rest to float32 precision (the sum
    less the token would keep an absolute error of ~1e-8, here 2e-4 relative)."""
    from vllm_univer.core.inverse_cdf import BlockCdf

    rest = torch.full((1, 999), 1e-4 / 999, dtype=torch.float64)
    weights = torch.cat([rest[:, :500], torch.tensor([[0.9999]], dtype=torch.float64), rest[:, 500:]], -1)
    exclude = torch.tensor([[500, -1, 500]])
    exact = rest.sum().item()
    total = BlockCdf(weights.float(), block=block).total(exclude=exclude)
    assert total.dtype == torch.float32 and total.shape == (1, 1)
    assert abs(total.item() - exact) <= 1e-6 * exact
    assert abs(BlockCdf(weights.float(), block=block).total().item() - 1.0) <= 1e-6
