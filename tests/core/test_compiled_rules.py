"""univer_wor's node rule compiled by torch.compile (``compiled_rules``) against the
rule it compiles: the exact law of every drafted tree (float64, every draw
enumerated on a tiny vocabulary, and random rows over a vocabulary large enough
for the log-scale ratio classes), and ``verify(compiled=True)`` sampled against
``outcome_law``. Inductor compiles to C++ here (a first call per variant takes
seconds); on CUDA the same graph becomes Triton kernels."""

import numpy as np
import pytest
import torch

from vllm_univer import TreeSpec, draft_children, outcome_law, verify
from vllm_univer.core.compiled_rules import COMPILE_ENV, compile_by_default, node_rule_for
from vllm_univer.tools.goodness_of_fit import chi_square_pvalue
from vllm_univer.tools.law_oracle import PathModel, batch_tensors, enumerate_trees

# Three children at the root (subtrees of 4, 2 and 1 nodes: uneven pairs, weighed by
# size), two below the first; 3x2: the three-children stage above leaves.
IRREGULAR = TreeSpec.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1)])
TREES = {"irregular": IRREGULAR, "2x2": TreeSpec.parse("2x2"), "3x2": TreeSpec.parse("3x2")}


@pytest.mark.parametrize("name, vocab", [("irregular", 4), ("2x2", 5), ("3x2", 3)])
def test_compiled_law_equals_rule_law_on_every_drafted_tree(name, vocab):
    """Every wor tree of the shape (zeros, ties, empty residuals; 1 296 to 13 824 trees):
    the compiled rule's exact step law is the eager rule's, which the exact suite proves
    lossless."""
    tree = TREES[name]
    target = PathModel(vocab, seed=11)
    draft = PathModel(vocab, seed=12, base=target)
    trees = enumerate_trees("wor", tree, draft)
    tokens, p, q = batch_tensors(tree, [t for _, t in trees], target, draft)
    eager = outcome_law("univer_wor", tree, tokens, p, q)
    compiled = outcome_law("univer_wor", tree, tokens, p, q, compiled=True)
    assert (compiled - eager).abs().max().item() <= 1e-12
    probs = torch.tensor([pr for pr, _ in trees], dtype=torch.float64)
    assert abs(probs.sum().item() - 1.0) < 1e-12  # every draw enumerated


@pytest.mark.parametrize("name", ["irregular", "3x2"])
def test_compiled_law_equals_rule_law_with_ratio_classes(name):
    """V = 300 (> EXACT_RANK_VOCAB): ratios compared by log-scale class, the path every
    real vocabulary takes; rows with zeros and ties, children drawn without replacement."""
    tree, vocab, batch = TREES[name], 300, 4
    gen = torch.Generator().manual_seed(5)
    n1 = tree.num_nodes + 1
    q = torch.softmax(torch.randn(batch, n1, vocab, generator=gen, dtype=torch.float64) * 2, -1)
    p = torch.softmax(torch.randn(batch, n1, vocab, generator=gen, dtype=torch.float64) * 2, -1)
    q[1, :, :] = 1.0 / vocab  # ties in q
    p = 0.5 * p + 0.5 * q
    p[0, :, : vocab // 3] = 0.0  # zeros in p
    p = p / p.sum(-1, keepdim=True)
    tokens = torch.full((batch, n1), -1, dtype=torch.long)
    for v in range(n1):
        kids = [c for c in tree.children[v].tolist() if c >= 0]
        if kids:
            tokens[:, kids] = draft_children("wor", q[:, v], len(kids), generator=gen)
    eager = outcome_law("univer_wor", tree, tokens, p, q)
    compiled = outcome_law("univer_wor", tree, tokens, p, q, compiled=True)
    assert (compiled - eager).abs().max().item() <= 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_compiled_verify_matches_outcome_law(dtype):
    """Seeded chi-square fit of ``verify(compiled=True)``'s (end node, next token)
    draws to the exact law, on four trees of the irregular shape."""
    tree, vocab, draws_per_tree = IRREGULAR, 5, 6000
    target = PathModel(vocab, seed=1)
    draft = PathModel(vocab, seed=2, base=target)
    trees = enumerate_trees("wor", tree, draft)
    rng = np.random.default_rng(3)
    picks = rng.choice(len(trees), size=4, replace=False, p=np.array([pr for pr, _ in trees]))
    tokens, p, q = batch_tensors(tree, [trees[i][1] for i in picks], target, draft, dtype=dtype)
    law = outcome_law("univer_wor", tree, tokens, p, q).numpy()
    gen = torch.Generator().manual_seed(1234)
    out = verify(
        "univer_wor",
        tree,
        *(t.repeat_interleave(draws_per_tree, 0) for t in (tokens, p, q)),
        generator=gen,
        compiled=True,
    )
    rows = torch.arange(len(out.end_node))
    y = out.output_token_ids[rows, tree.depth[out.end_node]]
    which = torch.arange(len(picks)).repeat_interleave(draws_per_tree)
    counts = np.bincount((which * law[0].size + out.end_node * vocab + y).numpy(), minlength=law.size)
    assert counts[law.reshape(-1) == 0].sum() == 0, "an outcome with exact probability 0 was sampled"
    for t in range(len(picks)):
        block = slice(t * law[0].size, (t + 1) * law[0].size)
        assert chi_square_pvalue(counts[block], law[t].reshape(-1)) > 1e-4, t


def test_compiled_rule_is_asked_for_clearly(monkeypatch):
    tree = TreeSpec.parse("2x2")
    tokens = torch.tensor([[-1, 0, 1, 2, 3, 0, 1]])
    p = torch.full((1, 7, 4), 0.25)
    with pytest.raises(ValueError, match="no compiled rule for 'univer'"):
        verify("univer", tree, tokens, p, p, compiled=True)
    with pytest.raises(ValueError, match="no compiled rule for 'rrsw'"):
        outcome_law("rrsw", tree, tokens, p, p, compiled=True)
    with pytest.raises(ValueError, match="pass fused=False"):
        verify("univer", tree, tokens, p, p, compiled=True, fused=True)
    monkeypatch.delenv(COMPILE_ENV, raising=False)
    assert not compile_by_default("univer_wor")
    monkeypatch.setenv(COMPILE_ENV, "1")
    assert compile_by_default("univer_wor") and not compile_by_default("univer")
    # Refused on CUDA (a failed law check on an H200): not by default, an error when asked.
    assert not compile_by_default("univer_wor", torch.device("cuda"))
    with pytest.raises(ValueError, match="refused on CUDA"):
        node_rule_for("univer_wor", True, torch.device("cuda"))
    assert node_rule_for("univer_wor", False, "cuda") is None
