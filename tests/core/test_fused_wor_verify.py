"""univer_wor's fused (Triton) path equals its PyTorch rule: run by Triton's
interpreter on CPU, in a subprocess (TRITON_INTERPRET must be set before Triton
is imported). Trees of at most four children per node (2x2, a binary irregular
tree with uneven pairs, a chain, an EAGLE-like tree with four and three children
above subtrees, 4x1; 3x1, 3x2 and an irregular tree for the three-child stage),
smooth rows and rows with zeros and ties,
children missing as wor drafts miss them (a slot only after the earlier ones):

* the law of the end node that the kernel's entry scales and stop probabilities
  give equals the PyTorch rule's to 1e-12 in float64 (to float32 rounding for
  float32 and bfloat16 rows, whose weights the kernel writes in float32);
* the next token the draw kernel returns at a given end node and uniform is the
  inverse CDF of that node's exact residual law (``outcome_law``), on a grid of
  uniforms away from the CDF's steps;
* ``verify(fused=True)`` returns well-formed outputs in a handful of ATen ops
  besides its launches (greedy rows: argmax matching), and refuses, clearly, a
  tree with five children at a node and a vocabulary of exact ratio ranks.

On a GPU, ``benchmarks/gpu_check.py`` samples ``verify`` (which takes this path
there) against ``outcome_law``.
"""

from __future__ import annotations

import textwrap

import pytest
from triton_interpreter import run_interpreted

pytest.importorskip("triton")

CHECK = textwrap.dedent("""
    import torch
    from vllm_univer import TreeSpec, outcome_law, verify
    from vllm_univer.core.fused_tree_pass import fused_wor_allocate
    from vllm_univer.core.kernels.triton_wor_verify import wor_draw
    from vllm_univer.tools.op_counter import OpCounter
    from vllm_univer.core.tree_pass import node_weights, end_node_law
    from vllm_univer.core.verifiers import get_verifier

    gen = torch.Generator().manual_seed(0)
    verifier = get_verifier("univer_wor")
    VOCAB = 100  # above EXACT_RANK_VOCAB: log-scale ratio classes, as the kernel compares them

    def rows(batch, n1, zeros):
        x = torch.softmax(torch.randn(batch, n1, VOCAB, generator=gen, dtype=torch.float64) * 2, -1)
        if zeros:
            x[..., : VOCAB // 3] = 0
            x[:, 1, :] = 1.0  # ties
        return x / x.sum(-1, keepdim=True)

    def wor_tokens(tree, q):
        # Each node's children drawn from its q row without replacement (a token q rules out
        # would put the end-node law on 0/0 conventions: an input of probability 0); a child
        # missing (cut) with its subtree and its later siblings.
        batch = q.shape[0]
        tokens = torch.zeros(batch, tree.num_nodes + 1, dtype=torch.long)
        gone = torch.rand(batch, tree.num_nodes + 1, generator=gen) < 0.15
        gone[:, 0] = False
        for parent in range(tree.num_nodes + 1):
            kids = tree.children[parent][tree.children[parent] >= 0].tolist()
            if kids:
                tokens[:, kids] = torch.multinomial(q[:, parent], len(kids), replacement=False, generator=gen)
        for node in range(1, tree.num_nodes + 1):  # breadth-first: parents and earlier siblings first
            parent = int(tree.parent[node])
            gone[:, node] |= gone[:, parent]
            kids = tree.children[parent].tolist()
            if kids.index(node):
                gone[:, node] |= gone[:, kids[kids.index(node) - 1]]
        return tokens.masked_fill(gone, -1)

    def check(spec, zeros, dtype):
        tree = TreeSpec.parse(spec)
        tt = tree.on("cpu")
        batch, n1 = 3, tree.num_nodes + 1
        p, q = rows(batch, n1, zeros), rows(batch, n1, not zeros)
        q[0] = p[0]  # q = p: empty residuals
        tokens = wor_tokens(tree, q)
        p_in, q_in = p.to(dtype), q.to(dtype)
        w_ref, s_ref = node_weights(verifier, tt, tokens, p_in.double(), q_in.double())
        work = torch.float64 if dtype == torch.float64 else torch.float32
        w, s = fused_wor_allocate(tt, tokens, p_in, q_in, work)
        law_ref, law = end_node_law(verifier, tt, w_ref, s_ref), end_node_law(verifier, tt, w.double(), s.double())
        tol = 1e-12 if dtype == torch.float64 else 2e-5
        assert (law - law_ref).abs().max() <= tol, (spec, zeros, dtype, (law - law_ref).abs().max())
        if dtype != torch.float64:
            return
        law_y = outcome_law("univer_wor", tree, tokens, p, q)  # [B, N+1, V]
        grid = torch.linspace(0.0005, 0.9995, 11, dtype=torch.float64)
        draws = 0
        for node in range(n1):
            for b in range(batch):
                y_law = law_y[b, node]
                if (node and tokens[b, node] < 0) or y_law.sum() <= 1e-9:
                    continue  # missing, never reached, or rounding decides whether R is empty
                cdf = (y_law / y_law.sum()).cumsum(0)
                us = grid[(cdf.unsqueeze(0) - grid.unsqueeze(1)).abs().min(1).values > 1e-9]
                k = us.numel()
                expected = torch.searchsorted(cdf, us, right=True).clamp(max=VOCAB - 1)
                sel = [b] * k
                got = wor_draw(p[sel], q[sel], tokens[sel], torch.full((k,), node), tt, w[sel].contiguous(), us)
                assert torch.equal(got, expected), (spec, zeros, node, b, got, expected)
                draws += k
        assert draws > 0

    BINARY = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]  # uneven pair at the root: subtrees of 3 and 1
    # Two pair stages: four children at the root (subtrees 3, 2, 1, 1), three at a child
    # above subtrees (pair, then a lone third slot), pairs and chains below.
    EAGLE = [[0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [0, 0, 0], [0, 1, 0]]
    # The three-child stage: three leaves below the root (all drawn, or the pair rule where one
    # is cut), three leaves below nodes beside a pair.
    THREE = [[0], [1], [2], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1]]
    for spec in ("2x2", BINARY, "1x3", EAGLE, "4x1", "3x1", "3x2", THREE):
        for zeros in (False, True):
            check(spec, zeros, torch.float64)
    check(BINARY, False, torch.float32)
    check(EAGLE, False, torch.float32)
    check("3x2", False, torch.float32)
    check("2x2", True, torch.bfloat16)

    # verify(fused=True): well-formed rows, greedy rows by argmax matching, few ATen ops.
    tree = TreeSpec.parse("2x3")
    batch, n1 = 4, tree.num_nodes + 1
    p, q = rows(batch, n1, False).float(), rows(batch, n1, False).float()
    tokens = wor_tokens(tree, q)
    greedy = torch.tensor([True, False, True, False])
    verify("univer_wor", tree, tokens, p, q, greedy=greedy, validate=False, fused=True)  # the tree's index tensors
    with OpCounter() as ops:
        out = verify("univer_wor", tree, tokens, p, q, greedy=greedy, validate=False, fused=True)
    ref = verify("univer_wor", tree, tokens, p, q, greedy=torch.ones(batch, dtype=torch.bool), validate=False)
    assert torch.equal(out.output_token_ids[greedy], ref.output_token_ids[greedy])
    for b in range(batch):
        k = int(out.num_accepted[b])
        row = out.output_token_ids[b].tolist()
        assert 0 <= row[k] < p.shape[-1] and all(t == -1 for t in row[k + 1 :]), row
    # Launch budget: besides its Triton launches (one per level, one for the draw), the ATen
    # ops of the decision, the greedy rows and the output rows (the interpreter's own tensor
    # plumbing, set_ / copy_ / new_empty, left out); the PyTorch rule: ~1 000 on this tree.
    ops.by_name.subtract({k: ops.by_name[k] for k in ("aten.set_", "aten.copy_", "aten.new_empty")})
    counts = OpCounter.summary(+ops.by_name)
    print("fused univer_wor 2x3, greedy rows and sampled ones:", counts)
    # 2026-12-07 (issue 61): + ~15 for lone_child_where_near_sure (top tokens, a masked
    # sum, the dropped slots and subtrees), which the kernels' first pass could fold in.
    assert counts["kernels"] <= 80 and counts["syncs"] == 0, sorted((+ops.by_name).items(), key=lambda kv: -kv[1])

    # Rows holding NaN and inf (verify's validation rejects them): the kernels' class tables
    # are never addressed out of bounds (the run ends; what it returns is meaningless).
    bad_p, bad_q = p.clone(), q.clone()
    bad_p[:, 0, :5] = float("nan")
    bad_q[:, 0, 5:9] = float("inf")
    bad_p[:, 1, 9:12], bad_q[:, 1, 9:12] = float("inf"), float("inf")
    out = verify("univer_wor", tree, tokens, bad_p, bad_q, validate=False, fused=True)
    assert out.output_token_ids.shape == (batch, tree.max_depth + 1)

    for spec, vocab in (("5x1", 100), ("2x2", 40)):
        tree = TreeSpec.parse(spec)
        p = torch.softmax(torch.randn(1, tree.num_nodes + 1, vocab, generator=gen), -1)
        tokens = torch.arange(tree.num_nodes + 1).unsqueeze(0)
        try:
            verify("univer_wor", tree, tokens, p, p, fused=True)
        except ValueError as exc:
            assert "univer_wor's kernels" in str(exc), exc
        else:
            raise AssertionError(f"fused=True accepted {spec} at V = {vocab}")
    print("WOR FUSED OK")
""")


def test_fused_univer_wor_equals_its_pytorch_rule_in_interpreter():
    run_interpreted(CHECK, "WOR FUSED OK")
