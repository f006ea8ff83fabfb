"""Per-request tree shapes (``core.tree_batch.TreeBatch``): every request's row verifies
exactly as its own ``TreeSpec`` does (float64, 1e-12), the sampling code draws that
law, greedy rows match argmax matching, and malformed batches fail clearly.

Each request's tree is read back from the batch's parents into a ``TreeSpec``
(``law_oracle.tree_of_row``) with a position -> node map, so the comparison needs no
knowledge of how the batch was laid out: positions are shuffled within each
depth, and some hold no node."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_univer.core.api import outcome_law, verify, verify_greedy
from vllm_univer.core.tree_batch import TREE_BATCH_METHODS, LevelLayout, TreeBatch
from vllm_univer.tools.goodness_of_fit import chi_square_pvalue
from vllm_univer.tools.law_oracle import tree_of_row

pytestmark = pytest.mark.quick


def random_batch(batch: int, level_sizes, max_children: int, seed: int, fill: float = 0.8) -> torch.Tensor:
    """parent [B, N+1]: per request, each position of depth d >= 1 holds a node with
    probability ``fill``, its parent a random node of depth d-1 with a free slot."""
    rng = np.random.default_rng(seed)
    starts = np.cumsum((0,) + tuple(level_sizes))
    parent = np.full((batch, starts[-1]), -1, dtype=np.int64)
    for b in range(batch):
        nodes_above, count = [0], {0: 0}
        for d in range(1, len(level_sizes)):
            here = []
            for pos in rng.permutation(np.arange(starts[d], starts[d + 1])):
                free = [v for v in nodes_above if count[v] < max_children]
                if free and (rng.random() < fill or (d == 1 and not here)):  # never an empty tree
                    v = int(rng.choice(free))
                    parent[b, pos] = v
                    count[v] += 1
                    count[int(pos)] = 0
                    here.append(int(pos))
            nodes_above = here
    return torch.from_numpy(parent)


def random_rows(parent: torch.Tensor, vocab: int, seed: int):
    """tokens [B, N+1] (-1 at empty positions; siblings distinct), p, q [B, N+1, V] float64."""
    g = torch.Generator().manual_seed(seed)
    batch, n1 = parent.shape
    keys = torch.rand(batch, n1, vocab, generator=g)
    tokens = torch.full((batch, n1), -1, dtype=torch.long)
    for b in range(batch):  # distinct tokens among one parent's children, as the schemes draw
        for par in set(parent[b].tolist()) - {-1}:
            kids = (parent[b] == par).nonzero().flatten()
            tokens[b, kids] = torch.randperm(vocab, generator=g)[: len(kids)]
    p = torch.softmax(3 * torch.randn(batch, n1, vocab, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(3 * torch.randn(batch, n1, vocab, generator=g, dtype=torch.float64), -1)
    del keys
    return tokens, p, q


def per_row_law(method, parent, tokens, p, q) -> torch.Tensor:
    """outcome_law of each request on its own TreeSpec, laid back onto the batch's positions."""
    out = torch.zeros_like(p)
    for b in range(parent.shape[0]):
        tree, node_of = tree_of_row(parent[b].tolist())
        pos_of = torch.tensor([pos for pos, _ in sorted(node_of.items(), key=lambda kv: kv[1])])
        law = outcome_law(method, tree, tokens[b : b + 1, pos_of], p[b : b + 1, pos_of], q[b : b + 1, pos_of])
        out[b, pos_of] = law[0]
    return out


LAYOUTS = [((1, 3, 5, 4), 3), ((1, 2, 4, 6, 3), 2), ((1, 4, 6), 4), ((1, 1, 1, 1), 1)]


@pytest.mark.parametrize("method", TREE_BATCH_METHODS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("seed", [0, 1])
def test_each_row_verifies_as_its_own_tree(method, layout, seed):
    level_sizes, max_children = layout
    parent = random_batch(6, level_sizes, max_children, seed)
    tokens, p, q = random_rows(parent, vocab=5, seed=seed)
    trees = TreeBatch(parent, level_sizes, max_children)
    law = outcome_law(method, trees, tokens, p, q)
    expected = per_row_law(method, parent, tokens, p, q)
    assert (law - expected).abs().max() < 1e-12
    assert torch.allclose(law.sum((1, 2)), torch.ones(6, dtype=torch.float64), atol=1e-12)


def test_shapes_really_differ_per_request():
    parent = random_batch(6, (1, 3, 5, 4), 3, seed=0)
    shapes = {tree_of_row(parent[b].tolist())[0].paths for b in range(6)}
    assert len(shapes) >= 4


def test_tables_match_each_tree():
    level_sizes, c = (1, 3, 5, 4), 3
    parent = random_batch(8, level_sizes, c, seed=3)
    trees = TreeBatch(parent, level_sizes, c)
    for b in range(8):
        tree, node_of = tree_of_row(parent[b].tolist())
        pos_of = {node: pos for pos, node in node_of.items()}
        for pos, node in node_of.items():
            kids = [pos_of[k] for k in tree.children[node].tolist() if k >= 0]
            assert trees.children[b, pos, : len(kids)].tolist() == kids
            assert (trees.children[b, pos, len(kids) :] == -1).all()
            path = [pos_of[a] for a in tree.ancestors[node].tolist() if a >= 0]
            assert trees.ancestors[b, pos, : len(path)].tolist() == path
        # post-order of the nodes: the same sequence as the TreeSpec's
        by_rank = sorted(node_of, key=lambda pos: int(trees.postorder_rank[b, pos]))
        assert [node_of[pos] for pos in by_rank] == tree.postorder_rank.argsort().tolist()


@pytest.mark.parametrize("method", TREE_BATCH_METHODS)
def test_sampled_outcomes_match_outcome_law(method):
    """The code that runs (verify: the decision and the draw) against the exact law,
    on a batch of different shapes repeated many times."""
    level_sizes, c, vocab, reps = (1, 3, 4), 2, 4, 6000
    parent = random_batch(3, level_sizes, c, seed=5, fill=0.9)
    tokens, p, q = random_rows(parent, vocab=vocab, seed=5)
    law = outcome_law(method, TreeBatch(parent, level_sizes, c), tokens, p, q)  # [3, N+1, V]
    big = TreeBatch(parent.repeat(reps, 1), level_sizes, c)
    g = torch.Generator().manual_seed(11)
    out = verify(method, big, tokens.repeat(reps, 1), p.repeat(reps, 1, 1), q.repeat(reps, 1, 1), generator=g)
    n1 = parent.shape[1]
    cell = (out.end_node * vocab + out.output_token_ids.gather(1, out.num_accepted.unsqueeze(-1)).squeeze(-1)).view(
        reps, 3
    )
    for b in range(3):
        counts = torch.bincount(cell[:, b], minlength=n1 * vocab).numpy()
        assert chi_square_pvalue(counts, law[b].reshape(-1).numpy()) > 1e-4, (method, b)


def test_greedy_rows_match_argmax_matching():
    level_sizes, c = (1, 3, 5, 4), 3
    parent = random_batch(8, level_sizes, c, seed=7, fill=0.9)
    tokens, p, q = random_rows(parent, vocab=3, seed=7)  # V = 3: argmax often drafted
    out = verify("univer", TreeBatch(parent, level_sizes, c), tokens, p, q, greedy=torch.ones(8, dtype=torch.bool))
    accepted_any = 0
    for b in range(8):
        tree, node_of = tree_of_row(parent[b].tolist())
        pos_of = torch.tensor([pos for pos, _ in sorted(node_of.items(), key=lambda kv: kv[1])])
        ref = verify_greedy(tree, tokens[b : b + 1, pos_of], p[b : b + 1, pos_of].argmax(-1))
        assert out.output_token_ids[b].tolist() == ref.output_token_ids[0].tolist()
        assert node_of[int(out.end_node[b])] == int(ref.end_node[0])
        accepted_any += int(ref.num_accepted[0])
    assert accepted_any > 0  # the walk went down somewhere


def _parent(rows):
    return torch.tensor(rows, dtype=torch.long)


@pytest.mark.parametrize(
    "rows, message",
    [
        ([[0, 0, 0]], "position 0 is the root"),
        ([[-1, 0, 2]], "not in the depth above"),
        ([[-1, -1, 1]], "holds no node"),
        ([[-1, 0, 1], [-1, 0, 0]], "not in the depth above"),
    ],
)
def test_malformed_batches_fail_clearly(rows, message):
    with pytest.raises(ValueError, match=message):
        TreeBatch(_parent(rows), (1, 1, 1), 1)


@pytest.mark.parametrize(
    "level_sizes, max_children, message",
    [
        ((2, 2), 2, "start with 1"),
        ((1, 0, 2), 2, "start with 1"),
        ((1,), 2, "at least one level"),
        ((1, 2), 0, "max_children must be >= 1"),
        ((1, 300, 300), 300, "at most"),
    ],
)
def test_malformed_levels_fail_clearly(level_sizes, max_children, message):
    with pytest.raises(ValueError, match=message):
        LevelLayout(level_sizes, max_children)
    parent = torch.full((1, max(sum(level_sizes), 1)), -1)
    with pytest.raises(ValueError, match=message):
        TreeBatch(parent, level_sizes, max_children)


def test_too_many_children_fail_clearly():
    with pytest.raises(ValueError, match="more than max_children"):
        TreeBatch(_parent([[-1, 0, 0, 0]]), (1, 3), 2)


@pytest.mark.parametrize("method", ["univer_wor", "rrs", "token", "block", "traversal"])
def test_other_verifiers_are_refused(method):
    parent = random_batch(2, (1, 2, 2), 2, seed=0)
    tokens, p, q = random_rows(parent, vocab=4, seed=0)
    with pytest.raises(ValueError, match="per-request tree shapes|single chain"):
        verify(method, TreeBatch(parent, (1, 2, 2), 2), tokens, p, q)


def test_compiled_is_refused():
    parent = random_batch(2, (1, 2, 2), 2, seed=0)
    tokens, p, q = random_rows(parent, vocab=4, seed=0)
    with pytest.raises(ValueError, match="no compiled node rule"):
        verify("univer", TreeBatch(parent, (1, 2, 2), 2), tokens, p, q, compiled=True)


FUSED_ROWS_CHECK = """
import os, sys
import torch
sys.path.insert(0, os.path.join(os.getcwd(), "tests", "core"))
from test_tree_batch import random_batch, random_rows
from vllm_univer import verify
from vllm_univer.core.fused_tree_pass import fused_node_weights
from vllm_univer.core.kernels.triton_finish_step import finish_step
from vllm_univer.core.tree_batch import TreeBatch
from vllm_univer.core.verifiers import get_verifier
from vllm_univer.tools.law_oracle import tree_of_row
from vllm_univer.tools.op_counter import OpCounter

gen = torch.Generator().manual_seed(0)
compared = 0
for case, (levels, c, vocab) in enumerate([((1, 2, 4, 3), 2, 7), ((1, 3, 2, 2), 3, 6), ((1, 2, 2, 2), 2, 300)]):
    batch = 5
    parent = random_batch(batch, levels, c, seed=case)
    tokens, p, q = random_rows(parent, vocab, seed=case)
    leaves = (tokens >= 0) & (torch.rand(tokens.shape, generator=gen) < 0.15)
    leaves &= ~(parent.unsqueeze(-1) == torch.arange(parent.shape[1])).any(1)  # absent draws: leaves only
    tokens = tokens.masked_fill(leaves, -1)
    trees = TreeBatch(parent, levels, c)
    for method in ("univer", "greedy", "target_only"):
        verifier = get_verifier(method)
        w, s, params = fused_node_weights(verifier, trees, tokens, p, q, torch.float64)
        u = torch.rand(batch, parent.shape[1] + 1, generator=gen, dtype=torch.float64)
        greedy = torch.arange(batch) % 3 == 2
        out, accepted, end = finish_step(method, p, q, tokens, trees, w, s, params, u, greedy)
        for b in range(batch):
            # The same request as its own TreeSpec through the shared-table kernels (checked
            # against the PyTorch rules and outcome_law in test_fused_verify.py): same numbers.
            tree, node_of = tree_of_row(parent[b].tolist())
            pos_of = torch.tensor([pos for pos, _ in sorted(node_of.items(), key=lambda kv: kv[1])])
            row = lambda x: x[b : b + 1, pos_of]
            tt = tree.on(torch.device("cpu"))
            w1, s1, params1 = fused_node_weights(verifier, tt, row(tokens), row(p), row(q), torch.float64)
            assert torch.equal(w[b, pos_of], w1[0]) and torch.equal(params[b, pos_of], params1[0]), (method, b)
            internal = tt.is_internal
            assert torch.equal(s[b, pos_of][internal], s1[0][internal]), (method, b)
            u1 = torch.cat([u[b, pos_of], u[b, -1:]]).unsqueeze(0)
            out1, acc1, end1 = finish_step(
                method, row(p), row(q), row(tokens), tt, w1, s1, params1, u1, greedy[b : b + 1]
            )
            assert int(pos_of[end1[0]]) == int(end[b]) and int(acc1[0]) == int(accepted[b]), (method, b)
            assert torch.equal(out1[0], out[b, : out1.shape[1]]) and (out[b, out1.shape[1]:] == -1).all(), (method, b)
            compared += 1
        # verify() takes the fused path for per-request shapes: well-formed rows, few ATen ops, no sync.
        seeded = torch.Generator().manual_seed(1)
        result = verify(method, trees, tokens, p, q, generator=seeded, greedy=greedy, fused=True)
        plain = verify(method, trees, tokens, p, q, greedy=greedy, fused=False)
        assert torch.equal(result.output_token_ids[greedy], plain.output_token_ids[greedy]), method
        assert ((result.output_token_ids >= 0).sum(1) == result.num_accepted + 1).all(), method
        with OpCounter() as ops:
            verify(method, trees, tokens, p, q, greedy=greedy, validate=False, fused=True)
        ops.by_name.subtract({k: ops.by_name[k] for k in ("aten.set_", "aten.copy_", "aten.new_empty")})
        counts = OpCounter.summary(+ops.by_name)
        print(method, levels, counts)
print("compared", compared)
print("FUSED ROWS OK")
"""


def test_fused_rules_equal_each_requests_own_tree_in_interpreter():
    """On CUDA per-request shapes take the fused node rules (one launch per level, one
    for the rest of the step: the kernels read each request's own children,
    post-order, internal flags and ancestors). In Triton's interpreter each request's
    weights, stop probabilities, residual factors, end node, accepted count and
    output row equal those of the same request verified alone on its own TreeSpec
    (the shared-table path), for the same uniforms; univer, greedy, target_only,
    absent draws and greedy rows included."""
    pytest.importorskip("triton")
    from triton_interpreter import run_interpreted

    print(run_interpreted(FUSED_ROWS_CHECK, "FUSED ROWS OK", timeout=1200)[-1500:])


def test_a_token_where_no_node_is_refused():
    parent = _parent([[-1, 0, -1]])
    tokens = torch.tensor([[-1, 1, 2]])
    p = torch.full((1, 3, 4), 0.25, dtype=torch.float64)
    with pytest.raises(ValueError, match="parent is missing"):
        verify("univer", TreeBatch(parent, (1, 2), 1), tokens, p, p.clone())


def test_ancestor_masks_and_token_paths_match_each_tree():
    level_sizes, c = (1, 3, 5, 4), 3
    parent = random_batch(6, level_sizes, c, seed=4)
    tokens, _, _ = random_rows(parent, vocab=6, seed=4)
    trees = TreeBatch(parent, level_sizes, c)
    paths = trees.token_paths(tokens)
    for b in range(6):
        tree, node_of = tree_of_row(parent[b].tolist())
        pos_of = {node: pos for pos, node in node_of.items()}
        for pos, node in node_of.items():
            seen = {pos_of[j] for j in torch.nonzero(tree.ancestor_mask[node]).flatten().tolist()}
            assert set(torch.nonzero(trees.ancestor_mask[b, pos]).flatten().tolist()) == seen
            path = [int(tokens[b, pos_of[a]]) for a in tree.ancestors[node].tolist() if a >= 0]
            assert paths[b, pos].tolist() == path + [-1] * (trees.max_depth - len(path))
        for pos in set(range(parent.shape[1])) - set(node_of):  # no node there: sees itself only
            assert torch.nonzero(trees.ancestor_mask[b, pos]).flatten().tolist() == [pos]


def test_cut_and_take_keep_each_requests_tree():
    level_sizes, c = (1, 3, 5, 4), 3
    parent = random_batch(5, level_sizes, c, seed=6)
    trees = TreeBatch(parent, level_sizes, c)
    cut = trees.cut(2)
    assert cut.level_sizes == (1, 3, 5) and cut.layout == trees.layout.cut(2)
    assert torch.equal(cut.ancestors, trees.ancestors[:, :9, :2])
    one = trees.take(2, 3)
    assert torch.equal(one.children, trees.children[2:3]) and torch.equal(one.postorder_rank, trees.postorder_rank[2:3])
    assert trees.layout.num_nodes == 12 and trees.layout.nodes_per_depth == [1, 3, 5, 4]
    assert trees.layout.depth.tolist() == trees.depth.tolist()


@pytest.mark.parametrize("level_sizes,max_children", [((1, 2, 4, 6, 6, 6, 6, 2), 2), ((1, 3, 2, 1), 3), ((1, 1, 1), 1)])
def test_static_tree_fills_the_levels(level_sizes, max_children):
    """``LevelLayout.static_tree`` (the tree a ``tree: dynamic`` step with a structured
    request drafts): node i at position i, each level's positions filled by the
    previous level's first nodes, C children each in slot order; a request's
    ``TreeBatch`` row of its parents is the same tree, node for node."""
    layout = LevelLayout(level_sizes, max_children)
    tree = layout.static_tree
    assert tree.nodes_per_depth == list(level_sizes) and tree.num_nodes == layout.num_nodes
    assert torch.equal(tree.depth, layout.depth)
    for d in range(1, len(level_sizes)):
        span, above = layout.spans[d], layout.spans[d - 1]
        parents = tree.parent[span].tolist()
        want = [above.start + i // max_children for i in range(level_sizes[d])]
        assert parents == want, (d, parents, want)
        assert tree.slot[span].tolist() == [i % max_children for i in range(level_sizes[d])]
    TreeBatch(tree.parent[None], level_sizes, max_children)  # a valid tree on these levels (validated)
    as_row, position_of = tree_of_row(tree.parent.tolist())
    assert as_row.paths == tree.paths and all(position_of[i] == i for i in range(len(tree.paths)))
    with pytest.raises(ValueError, match="positions below"):
        _ = LevelLayout((1, 2, 5), 2).static_tree
