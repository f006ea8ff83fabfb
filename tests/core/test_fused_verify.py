"""The fused (Triton) path of ``verify`` equals the PyTorch node rules: run by
Triton's interpreter on CPU, in a subprocess (TRITON_INTERPRET must be set
before Triton is imported). univer, greedy, target_only and rrs, rrsw,
traversal (one launch per level, one for the rest of the step), in two scripts:

* the law of the end node that the fused node weights and stop probabilities
  give (through the shared ``decide_*``: ``end_node_law``) equals the PyTorch
  rules' to 1e-12 in float64, and to float32 rounding for float32 and bfloat16
  rows (weights themselves may differ where a rule is 0/0-conditioned, e.g.
  q = p, only on events of probability ~1e-16);
* the next token drawn at a given end node with a given uniform is the inverse
  CDF of that node's exact residual law (``outcome_law``), checked on a grid of
  uniforms away from the CDF's steps (nodes whose residual mass is below 1e-9,
  where rounding decides emptiness, skipped), and an empty residual falls back
  to p;
* ``verify(fused=True)`` returns well-formed outputs whose greedy rows equal
  argmax matching.

token and block (a whole chain step in one launch): the end-node law of the
weights and stop probabilities the kernel writes equals the PyTorch rules', and
for random uniforms the end node and next token it returns are exactly what
``decide_*`` and the inverse CDF of the exact residual law give for the same
uniforms.

On a GPU, ``benchmarks/gpu_check.py`` samples ``verify`` (which takes this path
there) against ``outcome_law``.
"""

from __future__ import annotations

import textwrap

import pytest
from triton_interpreter import run_interpreted

pytest.importorskip("triton")

SPLITS_ENV = "VLLM_UNIVER_VERIFY_SPLITS"  # triton_rows' (imported in the subprocess only)

# Prepended to each interpreter script: random rows, and the launch count.
PRELUDE = textwrap.dedent("""
    import torch
    from vllm_univer import verify
    from vllm_univer.tools.op_counter import OpCounter

    gen = torch.Generator().manual_seed(0)

    def rows(batch, n1, vocab, zeros):
        x = torch.softmax(torch.randn(batch, n1, vocab, generator=gen, dtype=torch.float64) * 2, -1)
        if zeros:
            x[..., : vocab // 3] = 0
            x[:, 1, :] = 1.0  # ties
        return x / x.sum(-1, keepdim=True)

    # Launch budget (issue 12): besides its Triton launches, the fused path issues
    # these ATen ops per verify call (the interpreter's own tensor plumbing,
    # set_ / copy_ / new_empty, left out; allocations without a fill are no launch).
    INTERPRETER_OPS = {"aten.set_", "aten.copy_", "aten.new_empty"}
    def fused_aten_ops(method, tree, tokens, p, q, greedy):
        with OpCounter() as ops:
            verify(method, tree, tokens, p, q, greedy=greedy, validate=False, fused=True)
        ops.by_name.subtract({k: ops.by_name[k] for k in INTERPRETER_OPS})
        return OpCounter.summary(+ops.by_name)

    def check_fused_outputs(methods, tree, tokens, p, q, greedy, max_kernels):
        # verify(fused=True): greedy rows equal the PyTorch path's (argmax matching), every
        # row holds the accepted tokens, then the next one; few ATen ops, no host sync.
        for method in methods:
            fused = verify(method, tree, tokens, p, q, generator=torch.Generator().manual_seed(3), greedy=greedy,
                           fused=True)
            plain = verify(method, tree, tokens, p, q, greedy=greedy, fused=False)
            assert torch.equal(fused.output_token_ids[greedy], plain.output_token_ids[greedy]), method
            assert ((fused.output_token_ids >= 0).sum(1) == fused.num_accepted + 1).all(), method
            counts = fused_aten_ops(method, tree, tokens, p, q, greedy)
            assert counts["kernels"] <= max_kernels and counts["syncs"] == 0, (method, counts)

    IRREGULAR = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]]

    def draft_tokens(tree, batch, vocab, distinct=True):
        # topk1 and wor trees have distinct siblings (the sampled token is off the top
        # set); target_only takes any scheme and rrs iid trees, repeats included.
        tokens = torch.randint(0, vocab, (batch, tree.num_nodes + 1), generator=gen)
        for parent in range(tree.num_nodes + 1):
            kids = tree.children[parent][tree.children[parent] >= 0]
            if distinct and len(kids):
                tokens[:, kids] = torch.stack([torch.randperm(vocab, generator=gen)[: len(kids)] for _ in range(batch)])
        gone = torch.rand(batch, tree.num_nodes + 1, generator=gen) < 0.15
        gone[:, 0] = False
        for node in range(1, tree.num_nodes + 1):  # breadth-first: parents first
            gone[:, node] |= gone[:, int(tree.parent[node])]
        return tokens.masked_fill(gone, -1)
""")

CHECK_FUNCTIONS = textwrap.dedent("""
    import torch
    from vllm_univer import TreeSpec, outcome_law, verify
    from vllm_univer.core.fused_tree_pass import fused_node_weights
    from vllm_univer.core.kernels.triton_finish_step import finish_step
    from vllm_univer.core.tree_pass import (
        node_weights, decide_descent, decide_postorder, end_node_law, finish_stop, node_residuals
    )
    from vllm_univer.core.verifiers import Family, get_verifier

    def check_case(method, spec, vocab, zeros, dtype):
        tree = TreeSpec.parse(spec)
        tt = tree.on(torch.device("cpu"))
        verifier = get_verifier(method)
        batch, n1 = 4, tree.num_nodes + 1
        p, q = rows(batch, n1, vocab, zeros), rows(batch, n1, vocab, not zeros)
        if method != "target_only":
            q[0] = p[0]  # q = p: empty residuals at internal nodes
        tokens = draft_tokens(tree, batch, vocab, distinct=method not in ("target_only", "rrs"))
        w_ref, s_ref = node_weights(verifier, tt, tokens, p.to(dtype).double(), q.to(dtype).double())
        work = torch.float64 if dtype == torch.float64 else torch.float32
        w, s, params = fused_node_weights(verifier, tt, tokens, p.to(dtype), q.to(dtype), work)
        tol = 1e-12 if dtype == torch.float64 else 2e-5
        if verifier.family is Family.POSTORDER:
            s = finish_stop(tt, tokens, w, s).double()
        else:
            s = None
        law_ref, law_fused = end_node_law(verifier, tt, w_ref, s_ref), end_node_law(verifier, tt, w.double(), s)
        assert torch.allclose(law_fused, law_ref, atol=tol), (method, spec, (law_fused - law_ref).abs().max())
        assert torch.allclose(law_ref.sum(-1), torch.ones(batch, dtype=torch.float64))
        if dtype != torch.float64:
            return
        check_decisions(method, tree, tt, tokens, p, q, w, s, params)
        all_nodes = torch.arange(n1).expand(batch, -1)
        mass = node_residuals(verifier, tt, tokens, p, q, w_ref, all_nodes).sum(-1)  # [B, N+1]
        # Y at every existing node, on a grid of uniforms, against the exact residual law.
        law = outcome_law(method, tree, tokens, p, q)  # [B, N+1, V]
        grid = torch.linspace(0.0005, 0.9995, 21, dtype=torch.float64)
        for node in range(n1):
            exists = (tokens[:, node] >= 0) | (node == 0)
            for b in torch.nonzero(exists).flatten().tolist():
                y_law = law[b, node]
                if y_law.sum() <= 0 or mass[b, node] < 1e-9:
                    continue  # never reached, or rounding decides whether the residual is empty
                cdf = (y_law / y_law.sum()).cumsum(0)
                far = (cdf.unsqueeze(0) - grid.unsqueeze(1)).abs().min(1).values > 1e-9
                us = grid[far]
                k = us.numel()
                expected = torch.searchsorted(cdf, us, right=True).clamp(max=vocab - 1)
                # Rows of request b repeated k times; one uniform each (the generator's draws replaced).
                end = torch.full((k,), node)
                sel = [b] * k
                got = _draw_with(verifier, tt, tokens[sel], p[sel], q[sel], end, w[sel], params[sel], us)
                assert torch.equal(got, expected), (method, spec, node, b, got, expected)

    def _draw_with(verifier, tt, tokens, p, q, end, weight, params, uniforms):
        # finish_step at given end nodes: the next token at Y's uniform.
        u = torch.zeros(len(uniforms), tokens.shape[1] + 1, dtype=torch.float64)
        u[:, -1] = uniforms
        out, accepted, _ = finish_step(verifier.name, p, q, tokens, tt, weight, torch.zeros_like(weight), params,
                                       u, end=end)
        return out.gather(1, accepted.unsqueeze(1)).squeeze(1)

    def check_decisions(method, tree, tt, tokens, p, q, w, s, params, draws=16):
        # End node against decide_* for the same uniforms; greedy rows and output rows
        # against verify's PyTorch path.
        verifier = get_verifier(method)
        postorder = verifier.family is Family.POSTORDER
        batch, n1 = tokens.shape
        s = torch.zeros_like(w) if s is None else s  # DESCENT rules have no h
        threshold = finish_stop(tt, tokens, w, s) if postorder else w
        for _ in range(draws):
            u = torch.rand(batch, n1 + 1, generator=gen, dtype=torch.float64)
            greedy = torch.rand(batch, generator=gen) < 0.3
            out, accepted, end = finish_step(method, p, q, tokens, tt, w, s, params, u, greedy)
            eta = u[:, :n1]
            if postorder:
                want = decide_postorder(tt, threshold, eta)
            else:
                want = decide_descent(tt, threshold, eta, tree.max_depth)
            plain = verify(method, tree, tokens, p, q, greedy=greedy, fused=False)
            for b in range(batch):
                if greedy[b]:
                    assert torch.equal(out[b], plain.output_token_ids[b]), (method, b, out[b])
                    continue
                if (eta[b] - threshold[b]).abs().min() < 1e-9:
                    continue  # rounding decides this comparison
                assert end[b] == want[b], (method, b, end[b], want[b])
                e, d = int(end[b]), int(tt.depth[end[b]])
                assert int(accepted[b]) == d
                assert out[b, :d].tolist() == tokens[b, tt.ancestors[e, :d]].tolist() and (out[b, d + 1 :] == -1).all()

    # An exactly empty residual draws from p: target_only's children cover p's support.
    tree = TreeSpec.parse("2x1")
    tt = tree.on(torch.device("cpu"))
    target_only = get_verifier("target_only")
    p = torch.zeros(1, 3, 6, dtype=torch.float64)
    p[..., 2], p[..., 4] = 0.25, 0.75
    tokens = torch.tensor([[-1, 4, 2]])
    w, _, params = fused_node_weights(target_only, tt, tokens, p, p, torch.float64)
    us = torch.tensor([0.1, 0.3, 0.9], dtype=torch.float64)
    p3 = p.expand(3, -1, -1)
    root = torch.zeros(3, dtype=torch.long)
    w3, scale3 = w.expand(3, -1), params.expand(3, -1)
    got = _draw_with(target_only, tt, tokens.expand(3, -1), p3, p3, root, w3, scale3, us)
    assert got.tolist() == [2, 4, 4], got
""")

CHECK = CHECK_FUNCTIONS + textwrap.dedent("""
    for method in METHODS:
        for spec in ("2x2", "3x2", "1x3", IRREGULAR):
            for zeros in (False, True):
                check_case(method, spec, 7, zeros, torch.float64)
        check_case(method, "2x2", 5000, False, torch.float64)  # two vocabulary blocks
        check_case(method, "2x3", 300, False, torch.float32)
        check_case(method, "2x3", 300, True, torch.bfloat16)


    # verify(fused=True): outputs well formed; greedy rows are argmax matching.
    tree = TreeSpec.parse("2x3")
    p, q = rows(8, tree.num_nodes + 1, 50, False), rows(8, tree.num_nodes + 1, 50, False)
    tokens = draft_tokens(tree, 8, 50)
    greedy = torch.arange(8) % 2 == 0
    check_fused_outputs(METHODS, tree, tokens, p, q, greedy, 8)  # 716-763 ATen ops by the PyTorch rules
    print("FUSED OK")
""")


CHAIN_CHECK = textwrap.dedent("""
    import torch
    from vllm_univer import TreeSpec, outcome_law, verify
    from vllm_univer.core.kernels.triton_chain_verify import chain_verify
    from vllm_univer.core.tree_pass import node_weights, decide_descent, decide_postorder, end_node_law, finish_stop
    from vllm_univer.core.verifiers import Family, get_verifier

    def check_case(method, depth, vocab, zeros, dtype, samples=40):
        tree = TreeSpec.parse(f"1x{depth}")
        tt = tree.on(torch.device("cpu"))
        verifier = get_verifier(method)
        batch, n1 = 6, depth + 1
        p, q = rows(batch, n1, vocab, zeros), rows(batch, n1, vocab, not zeros)
        q[0] = p[0]  # q = p: empty residuals
        tokens = torch.randint(0, vocab, (batch, n1), generator=gen)
        tokens[1, 2:] = -1  # a chain cut short
        if vocab > 3:
            tokens[2, 1:] = (p[2, :-1].argmax(-1))  # every draft the target's favourite
        p_in, q_in = p.to(dtype), q.to(dtype)
        ref_w, ref_s = node_weights(verifier, tt, tokens, p_in.double(), q_in.double())
        postorder = verifier.family is Family.POSTORDER
        uniforms = torch.rand(batch, n1 + 1, generator=gen, dtype=torch.float64)
        _, _, w, s = chain_verify(method, p_in, q_in, tokens, uniforms)
        tol = 1e-12 if dtype == torch.float64 else 2e-5
        law_ref = end_node_law(verifier, tt, ref_w, ref_s)
        law = end_node_law(verifier, tt, w, s if postorder else None)
        assert torch.allclose(law, law_ref, atol=tol), (method, depth, (law - law_ref).abs().max())
        if dtype != torch.float64:
            return
        # End node and next token for many uniforms, against decide_* and the exact residual law.
        y_law = outcome_law(method, tree, tokens, p, q)  # [B, N+1, V]
        threshold = ref_s if postorder else ref_w
        checked = 0
        for _ in range(samples):
            u = torch.rand(batch, n1 + 1, generator=gen, dtype=torch.float64)
            greedy = torch.rand(batch, generator=gen) < 0.3
            out, end, _, _ = chain_verify(method, p, q, tokens, u, greedy)
            nxt = out.gather(1, end.unsqueeze(1)).squeeze(1)
            # Greedy rows: argmax matching; their output rows are verify's PyTorch path's.
            plain = verify(method, tree, tokens, p, q, greedy=greedy, fused=False)
            assert torch.equal(out[greedy], plain.output_token_ids[greedy]), (method, depth)
            # Every row: the accepted drafts, then the next token, then -1.
            for b in range(batch):
                e = int(end[b])
                assert out[b, :e].tolist() == tokens[b, 1 : e + 1].tolist() and (out[b, e + 1 :] == -1).all()
            eta = u[:, :n1]
            want = decide_postorder(tt, threshold, eta) if postorder else decide_descent(tt, threshold, eta, depth)
            for b in range(batch):
                if greedy[b] or (eta[b] - threshold[b]).abs().min() < 1e-9:
                    continue  # rounding decides this comparison
                assert end[b] == want[b], (method, depth, b, end[b], want[b])
                row = y_law[b, int(want[b])]
                cdf = (row / row.sum()).cumsum(0)
                if (cdf - u[b, n1]).abs().min() < 1e-9:
                    continue
                expected = int(torch.searchsorted(cdf, u[b, n1 : n1 + 1], right=True).clamp(max=vocab - 1))
                assert int(nxt[b]) == expected, (method, depth, b, int(want[b]), int(nxt[b]), expected)
                checked += 1
        assert checked > samples * batch // 3, checked

    for method in ("token", "block"):
        for depth in (1, 3, 5):
            for zeros in (False, True):
                check_case(method, depth, 7, zeros, torch.float64)
        check_case(method, 2, 5000, False, torch.float64, samples=20)  # two vocabulary blocks
        check_case(method, 5, 300, False, torch.float32)
        check_case(method, 5, 300, True, torch.bfloat16)


    # verify(fused=True): outputs well formed; greedy rows are argmax matching (drafts
    # partly the target's argmax, so that walks go deep), first index on ties.
    tree = TreeSpec.parse("1x5")
    p, q = rows(8, 6, 50, False), rows(8, 6, 50, False)
    p[:, :, 7] = p[:, :, 3] = p.max(-1).values  # ties
    p = p / p.sum(-1, keepdim=True)
    tokens = torch.randint(0, 50, (8, 6), generator=gen)
    tokens[::3, 1:] = 3
    greedy = torch.arange(8) % 2 == 0
    check_fused_outputs(("token", "block"), tree, tokens, p, q, greedy, 3)  # 363-427 by the PyTorch rules
    print("CHAIN OK")
""")


# The same checks with every level's vocabulary split in slices (on CUDA where a level
# cannot fill the GPU: one request), forced by the environment; the slice count itself.
SPLIT_CHECK = CHECK_FUNCTIONS + textwrap.dedent("""
    from vllm_univer.core.kernels.triton_rows import split_count

    for method in METHODS:
        for spec in ("2x2", IRREGULAR):
            for zeros in (False, True):
                check_case(method, spec, 7, zeros, torch.float64)  # slices of 3, 3 and 1 tokens
        check_case(method, "2x2", 5000, False, torch.float64)  # slices of 1667 tokens, 2048-token blocks
        check_case(method, "2x3", 300, True, torch.float32)

    # verify(fused=True): greedy rows are argmax matching, rows well formed, no host sync.
    tree = TreeSpec.parse("2x3")
    p, q = rows(6, tree.num_nodes + 1, 50, False), rows(6, tree.num_nodes + 1, 50, False)
    tokens = draft_tokens(tree, 6, 50)
    greedy = torch.arange(6) % 2 == 0
    check_fused_outputs(METHODS, tree, tokens, p, q, greedy, 8)

    # About two programs per multiprocessor, slices of at least 4096 tokens, at most 64.
    assert split_count(1, 151936, 132) == 37
    assert split_count(8, 151936, 132) == 33
    assert split_count(64, 151936, 132) == 5
    assert split_count(132, 151936, 132) == 1
    assert split_count(1, 4000, 132) == 1
    assert split_count(1, 10**6, 132) == 64
    print("SPLITS OK")
""")


def test_fused_topk1_verify_equals_the_node_rules_in_interpreter():
    run_interpreted(PRELUDE + 'METHODS = ("univer", "greedy", "target_only")' + CHECK, "FUSED OK")


@pytest.mark.parametrize("methods", [("univer", "greedy", "target_only"), ("rrs", "rrsw", "traversal")])
def test_fused_verify_with_split_vocabulary_equals_the_node_rules_in_interpreter(methods):
    script = PRELUDE + f"METHODS = {methods!r}" + SPLIT_CHECK
    run_interpreted(script, "SPLITS OK", env={SPLITS_ENV: "3"})


def test_fused_replay_verify_equals_the_node_rules_in_interpreter():
    run_interpreted(PRELUDE + 'METHODS = ("rrs", "rrsw", "traversal")' + CHECK, "FUSED OK")


def test_fused_chain_step_equals_the_node_rules_and_decisions_in_interpreter():
    run_interpreted(PRELUDE + CHAIN_CHECK, "CHAIN OK")


def test_fused_path_refuses_what_its_kernels_cannot_take():
    import torch

    from vllm_univer import TreeSpec, verify

    tree = TreeSpec.parse("2x2")
    p = torch.full((1, 7, 4), 0.25)
    # univer_wor's kernels: at most four children per node, log-scale ratio classes (V > 64).
    with pytest.raises(ValueError, match="at most four children per node"):
        five = torch.full((1, 6, 4), 0.25)
        verify("univer_wor", TreeSpec.parse("5x1"), torch.zeros(1, 6, dtype=torch.long), five, five, fused=True)
    with pytest.raises(ValueError, match="vocabularies above 64 tokens"):
        verify("univer_wor", tree, torch.zeros(1, 7, dtype=torch.long), p, p, fused=True, validate=False)
