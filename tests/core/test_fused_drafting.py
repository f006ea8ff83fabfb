"""The fused (Triton) drafting of one level, run by Triton's interpreter on CPU in
a subprocess (TRITON_INTERPRET must be set before Triton is imported):

* ``draft_children_fused`` for every scheme: top tokens equal
  ``drafting.top_tokens`` (rank order, ties to the lower id, logits with -inf
  included), and each drawn token is the inverse CDF, at the uniform the kernel
  was given, of the scheme's exact law (q; q off the tokens drawn so far for
  wor; q off the top set for topk1's slot 0), -1 where nothing is left;
  float64, float32 and bfloat16 rows, zeros and ties, two vocabulary blocks;
* ``top_tokens_fused`` (``top_tokens``' CUDA path) against ``top_tokens``;
* its ``into`` write of the children into the token table (-1 under a node
  without a token, nothing else touched);
* the engine drafter's level step (``TreeDrafter._draw_children``) on that path:
  an irregular tree's child groups, mixed greedy rows and all-greedy logits, a
  node without a token, a seeded request (the kernel's draws written by the drafter).

The engine takes this path on CUDA; on CPU it runs ``drafting.draft_children``,
whose law the exact-law tests check.
"""

from __future__ import annotations

import textwrap

import pytest
from triton_interpreter import run_interpreted

pytest.importorskip("triton")

DRAFT_CHECK = textwrap.dedent("""
    from types import SimpleNamespace

    import numpy as np
    import torch
    from vllm_univer import TreeSpec
    from vllm_univer.core.drafting import top_tokens
    from vllm_univer.integration import tree_drafter
    from vllm_univer.integration.tree_drafter import GreedyRows, TreeDrafter, _Shape
    from vllm_univer.core.kernels.triton_draft_children import draft_children_fused

    gen = torch.Generator().manual_seed(0)


    def rows(batch, width, vocab, zeros, dtype):
        x = torch.softmax(torch.randn(batch, width, vocab, generator=gen, dtype=torch.float64) * 2, -1)
        if zeros:
            x[..., : vocab // 3] = 0
            x[:, 0, vocab // 2 : vocab // 2 + 3] = x[:, 0].max(-1, keepdim=True).values  # ties at the top
        x[0, -1] = 0
        x[0, -1, 1:3] = 0.5  # two tokens hold everything: wor / topk1 run out
        return (x / x.sum(-1, keepdim=True)).to(dtype)


    def inverse_cdf(w, u):
        # The token at u of w's inverse CDF (float64); -1 if w is empty; None near a step.
        if w.sum() <= 0:
            return -1
        cdf = (w / w.sum()).cumsum(0)
        if (cdf - u).abs().min() < 1e-9:
            return None
        return int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64), right=True).clamp(max=len(w) - 1))


    def check(scheme, m, vocab, zeros, dtype, batch=5):
        q = rows(batch, 3, vocab, zeros, dtype)
        row_index = torch.tensor([2, 0])
        greedy = torch.arange(batch) % 3 == 1
        seed = int(torch.randint(0, 2**30, (1,), generator=gen))
        got = draft_children_fused(scheme, q, row_index, m, greedy, generator=torch.Generator().manual_seed(seed))
        u = torch.rand(batch, 2, m, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        assert got.shape == (batch, 2, m) and got.dtype == torch.long
        checked = 0
        for r in range(batch):
            for k, w in enumerate(row_index.tolist()):
                row = q[r, w]
                kids = got[r, k].tolist()
                if greedy[r]:
                    assert kids == top_tokens(row, m).tolist(), (scheme, r, k, kids)
                    continue
                row64 = row.double()
                if scheme == "topk1":
                    top = top_tokens(row, m - 1).tolist()
                    assert kids[1:] == top, (scheme, kids, top)
                    off = row64.clone()
                    off[top] = 0
                    want = [inverse_cdf(off, float(u[r, k, 0]))] + top
                else:
                    want = []
                    for j in range(m):
                        off = row64.clone()
                        if scheme == "wor":
                            off[[t for t in kids[:j] if t >= 0]] = 0
                        want.append(inverse_cdf(off, float(u[r, k, j])))
                for j in range(m):
                    if want[j] is not None:
                        assert kids[j] == want[j], (scheme, m, vocab, r, k, j, kids, want)
                        checked += 1
        assert checked >= batch, checked


    for scheme, ms in (("chain", (1,)), ("iid", (1, 3)), ("wor", (2, 3)), ("topk1", (1, 2, 3))):
        for m in ms:
            for zeros in (False, True):
                check(scheme, m, 7, zeros, torch.float64)
            check(scheme, m, 300, True, torch.bfloat16)
        check(scheme, ms[-1], 5000, False, torch.float32)  # two vocabulary blocks

    # Per-node child counts (context-aware trees, ``dynamic_tree.draw_children``'s law):
    # node v's slot 0 drawn off its own k_v - 1 top tokens, greedy rows its k_v top
    # tokens, -1 from slot k_v on (k_v = 0: no children).
    for m, vocab, dtype in ((2, 7, torch.float64), (3, 7, torch.float64), (3, 300, torch.bfloat16)):
        batch = 6
        q = rows(batch, 3, vocab, True, dtype)
        row_index = torch.tensor([2, 0, 1])
        k_v = torch.randint(0, m + 1, (batch, 3), generator=gen)
        k_v[0] = torch.tensor([0, 1, m])
        greedy = torch.arange(batch) % 3 == 1
        seed = int(torch.randint(0, 2**30, (1,), generator=gen))
        got = draft_children_fused(
            "topk1", q, row_index, m, greedy, generator=torch.Generator().manual_seed(seed), node_children=k_v
        )
        u = torch.rand(batch, 3, m, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        checked = 0
        for r in range(batch):
            for k, w in enumerate(row_index.tolist()):
                row, kv, kids = q[r, w], int(k_v[r, k]), got[r, k].tolist()
                assert kids[kv:] == [-1] * (m - kv), (m, r, k, kv, kids)
                if greedy[r]:
                    assert kids[:kv] == top_tokens(row, m).tolist()[:kv], (r, k, kids)
                    continue
                if kv == 0:
                    continue
                top = top_tokens(row, kv - 1).tolist() if kv > 1 else []
                assert kids[1:kv] == top, (r, k, kids, top)
                off = row.double().clone()
                off[top] = 0
                want = inverse_cdf(off, float(u[r, k, 0]))
                if want is not None:
                    assert kids[0] == want, (m, r, k, kv, kids, want)
                    checked += 1
        assert checked >= 4, checked
    try:
        draft_children_fused("wor", q, row_index, m, node_children=k_v)
        raise AssertionError("per-node counts accepted for wor")
    except ValueError as exc:
        assert "topk1" in str(exc)

    # Every row greedy, on logits with banned tokens at -inf (no uniforms drawn).
    logits = torch.randn(4, 2, 50, generator=gen)
    logits[..., ::3] = float("-inf")
    logits[1, 0, 5] = logits[1, 0, 7] = logits[1, 0].max() + 1  # a tie at the top
    for m in (1, 2, 3):
        got = draft_children_fused("topk1", logits, torch.tensor([0, 1]), m, all_greedy=True)
        assert torch.equal(got, top_tokens(logits, m)), (m, got)

    # ``into``: the same children written into a token table, -1 under a node without a
    # token, nothing else touched (nodes 1 and 3 of a 7-entry table, children 4-5 and 2, 6).
    q = rows(5, 3, 300, True, torch.float32)
    for scheme in ("topk1", "wor", "iid"):
        table = torch.randint(0, 300, (5, 7), generator=gen)
        table[1, 3] = table[4, 1] = -1
        before = table.clone()
        nodes, kids = torch.tensor([1, 3]), torch.tensor([[4, 5], [2, 6]])
        seed = int(torch.randint(0, 2**30, (1,), generator=gen))
        greedy = torch.arange(5) % 2 == 0
        args = (scheme, q, torch.tensor([2, 0]), 2, greedy)
        plain = draft_children_fused(*args, generator=torch.Generator().manual_seed(seed))
        got = draft_children_fused(*args, generator=torch.Generator().manual_seed(seed), into=(table, nodes, kids))
        assert torch.equal(got, plain), scheme
        want = before.clone()
        want[:, kids.flatten()] = got.masked_fill((before[:, nodes] < 0).unsqueeze(-1), -1).flatten(1)
        assert torch.equal(table, want), (scheme, table, want)
        assert (table[1, [2, 6]] == -1).all() and (table[4, [4, 5]] == -1).all() and (table[0, [2, 4, 5, 6]] >= 0).all()
    print("DRAFT OK")

    # The drafter's level step takes the kernel where Triton reads the rows (forced
    # here on CPU): an irregular tree's groups (one of them not a slice), mixed greedy
    # rows, then every row greedy on logits.

    tree_drafter.triton_reads = lambda *rows: True
    tree = TreeSpec.from_paths([[0], [1], [2], [0, 0], [0, 1], [2, 0], [2, 1], [1, 0], [1, 1], [1, 2]])
    shape = _Shape(tree, torch.device("cpu"))
    reqs, vocab = 4, 40
    for scheme in ("topk1", "wor"):
        drafter = SimpleNamespace(scheme=scheme, child_groups=shape.groups)
        tokens = torch.full((reqs, tree.num_nodes + 1), -1)
        tokens[:, 0] = 5
        host = torch.tensor([True, False, False, True])
        greedy = GreedyRows(host.clone(), host, True, False)
        for d in range(tree.max_depth):
            first, last = shape.level_span[d]
            q = rows(reqs, last - first + 1, vocab, False, torch.float32)
            TreeDrafter._draw_children(drafter, d, tokens, q, greedy, {}, np.arange(reqs))
            for parents, kids, m, in_level, _ in shape.groups[d]:
                level = q[:, in_level]  # [R, g, V]
                drawn = tokens[:, kids]  # [R, g, m]
                assert torch.equal(drawn[host], top_tokens(level[host], m)), (scheme, d)
                if scheme == "topk1" and m > 1:
                    assert torch.equal(drawn[~host][..., 1:], top_tokens(level[~host], m - 1)), (scheme, d)
                assert (drawn >= 0).all() and (drawn.sort(-1).values.diff(dim=-1) != 0).all()  # distinct siblings
        # A node without a token gets none below it; a seeded request draws from its own
        # generator (the kernel then returns the draws and the drafter writes the table).
        for generators in ({}, {2: torch.Generator().manual_seed(3)}):
            tokens[:, shape.level_span[2][0] :] = -1  # depth 2 to be drawn again
            tokens[1, 2] = -1  # node 2 (depth 1) of request 1
            first, last = shape.level_span[1]
            q = rows(reqs, last - first + 1, vocab, False, torch.float32)
            TreeDrafter._draw_children(drafter, 1, tokens, q, greedy, generators, np.arange(reqs))
            for parents, kids, m, in_level, _ in shape.groups[1]:
                for k, parent in enumerate(parents.tolist()):
                    below = tokens[:, kids[k]]
                    assert (below[1] == -1).all() if parent == 2 else (below[1] >= 0).all(), (scheme, parent, below)
                    assert (below[[0, 2, 3]] >= 0).all(), (scheme, generators, below)
            tokens[1, 2] = 7  # a token again for the all-greedy step below
        logits = torch.randn(reqs, 3, vocab, generator=gen)
        every = GreedyRows(torch.ones(reqs, dtype=torch.bool), torch.ones(reqs, dtype=torch.bool), True, True)
        TreeDrafter._draw_children(drafter, 1, tokens, logits, every, {}, np.arange(reqs))
        for parents, kids, m, in_level, _ in shape.groups[1]:
            assert torch.equal(tokens[:, kids], top_tokens(logits[:, in_level], m)), (scheme, "all greedy")

    # top_tokens' CUDA path (one launch, no host read): the same tokens, ties across the
    # k-th token included (bfloat16 rows, zeros, logits at -inf), any leading shape.
    from vllm_univer.core.kernels.triton_draft_children import top_tokens_fused

    for dtype in (torch.float32, torch.bfloat16):
        x = rows(3, 4, 300, True, dtype)
        x[1, 2] = 0
        x[1, 2, [5, 9, 40]] = 0.25  # three tokens tie for first, the rest tie at zero
        logits = torch.randn(3, 4, 300, generator=gen).to(dtype).masked_fill(x == 0, float("-inf"))
        for k in (2, 3, 5):
            for t in (x, logits, x[0], logits[:, 1:3].transpose(0, 1)):
                assert torch.equal(top_tokens_fused(t, k), top_tokens(t, k)), (dtype, k, tuple(t.shape))
    print("DRAFTER OK")
""")


def test_fused_draft_children_follow_the_schemes_in_interpreter():
    pytest.importorskip("vllm")
    run_interpreted(DRAFT_CHECK, "DRAFTER OK")
