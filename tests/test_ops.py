"""Tensor helpers whose CPU path differs from their one-pass form."""

from __future__ import annotations

import torch

from vllm_univer import TreeSpec, draft_children, outcome_law
from vllm_univer import ops


def test_sum_of_min_in_chunks_equals_one_pass(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    a = torch.rand(2, 3, 5000, generator=gen, dtype=torch.float64)
    b = torch.rand(2, 3, 5000, generator=gen, dtype=torch.float64)
    scale = torch.rand(2, 3, 1, generator=gen, dtype=torch.float64)
    one_pass = torch.minimum(a, b * scale).sum(-1, keepdim=True)
    monkeypatch.setattr(ops, "_CPU_CHUNK_ELEMENTS", 1)  # chunks of 1024: four whole, one partial
    chunked = ops.sum_of_min(a, b, scale)
    assert chunked.shape == (2, 3, 1)
    torch.testing.assert_close(chunked, one_pass, rtol=1e-12, atol=0)
    # A view of a level's rows (strided over the batch) and a plain float scale.
    expected = torch.minimum(a[:, 1:2], b[:, 1:2] * 0.5).sum(-1, keepdim=True)
    torch.testing.assert_close(ops.sum_of_min(a[:, 1:2], b[:, 1:2], 0.5), expected, rtol=1e-12, atol=0)


def test_univer_law_is_the_same_with_chunked_reductions(monkeypatch):
    """UniVer's exact outcome law on a 3000-token vocabulary, with its vocabulary
    sums in chunks of 1024 and in one pass."""
    tree = TreeSpec.parse("2x2")
    gen = torch.Generator().manual_seed(1)
    vocab, n1 = 3000, tree.num_nodes + 1
    q = torch.randn(3, n1, vocab, generator=gen, dtype=torch.float64).mul(4).softmax(-1)
    p = (0.6 * q + 0.4 * torch.randn(3, n1, vocab, generator=gen, dtype=torch.float64).mul(4).softmax(-1))
    tokens = torch.full((3, n1), -1, dtype=torch.long)
    tokens[:, 0] = 0
    for v in range(n1):
        kids = [c for c in tree.children[v].tolist() if c >= 0]
        if kids:
            tokens[:, kids] = draft_children("topk1", q[:, v], len(kids), generator=gen)
    one_pass = outcome_law("univer", tree, tokens, p, q)
    monkeypatch.setattr(ops, "_CPU_CHUNK_ELEMENTS", 1)
    torch.testing.assert_close(outcome_law("univer", tree, tokens, p, q), one_pass, rtol=1e-12, atol=1e-15)
