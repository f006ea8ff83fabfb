"""The Triton paged tree-attention kernel (the CUDA path) equals the PyTorch
reference, run by Triton's interpreter on CPU (in a subprocess, so that
TRITON_INTERPRET is set before Triton is imported)."""

from __future__ import annotations

import textwrap

import pytest
from triton_interpreter import run_interpreted

pytest.importorskip("triton")

CHECK = textwrap.dedent("""
    import torch
    from vllm_univer import TreeSpec
    from vllm_univer.integration.attention.tree_attention import gather_paged, tree_attention
    from vllm_univer.integration.attention.triton_paged_tree_attention import paged_tree_attention_triton

    gen = torch.Generator().manual_seed(0)
    BLOCK, BLOCKS = 16, 64

    def paged_cache(kv_heads, head_size, dtype, transposed_keys):
        # vLLM's logical layout [blocks, Hkv, block, 2*Dh]; views [blocks, block, Hkv, Dh].
        kv = torch.randn(BLOCKS, kv_heads, BLOCK, 2 * head_size, generator=gen).to(dtype)
        keys, values = kv.transpose(1, 2).split(head_size, dim=-1)
        if transposed_keys:  # keys stored [Dh, block] inside (block, head), as vLLM's CPU 'vec' ISA does
            store = torch.randn(BLOCKS, kv_heads, head_size, BLOCK, generator=gen).to(dtype)
            keys = store.permute(0, 3, 1, 2)
        return keys, values

    def check(spec, q_heads, kv_heads, head_size, context, level=None, dtype=torch.float32, transposed=False,
              cut=None, atol=2e-5, splits=None):
        tree = TreeSpec.parse(spec)
        mask = tree.ancestor_mask
        if level is not None:  # drafting one level: its nodes query the tree keys up to the level's end
            first, last = level
            mask = mask[first:last + 1, :last + 1]
        num_q, num_k = mask.shape
        reqs = len(context)
        keys, values = paged_cache(kv_heads, head_size, dtype, transposed)
        perm = torch.randperm(BLOCKS, generator=gen)
        need = [-(-(c + num_k) // BLOCK) for c in context]
        table = torch.zeros(reqs, max(need) + 2, dtype=torch.int32)
        used = 0
        for r, n in enumerate(need):
            table[r, :n] = perm[used:used + n]
            used += n
        context_lens = torch.tensor(context)
        # Tree rows interleaved with ordinary rows of the same forward.
        tokens = reqs * num_q + 7
        rows = torch.randperm(tokens, generator=gen)[:reqs * num_q].view(reqs, num_q)
        query = torch.randn(tokens, q_heads, head_size, generator=gen).to(dtype)
        valid = None
        if cut is not None:
            valid = torch.arange(num_q).unsqueeze(0) < torch.tensor(cut).unsqueeze(1)
        output = torch.full_like(query, 7.0)
        paged_tree_attention_triton(query, keys, values, table, context_lens, rows, mask, output, scale=0.3,
                                    row_valid=valid, max_context_len=max(context), num_splits=splits)
        positions = context_lens.unsqueeze(1) + torch.arange(num_k)
        tree_k = gather_paged(keys, table, positions)
        tree_v = gather_paged(values, table, positions)
        ref = tree_attention(query[rows].double(), tree_k.double(), tree_v.double(), keys.double(),
                             values.double(), table, context_lens, mask, scale=0.3)
        written = torch.zeros(tokens, dtype=torch.bool)
        done = rows if valid is None else rows[valid]
        written[done.flatten()] = True
        got = output[rows].double()
        sel = torch.ones_like(rows, dtype=torch.bool) if valid is None else valid
        torch.testing.assert_close(got[sel], ref[sel], atol=atol, rtol=atol)
        assert (output[~written] == 7.0).all(), "rows outside the plan were written"
        # A causal mask over the tree (siblings visible) gives a different answer.
        if not tree.is_chain and level is None:
            causal = torch.ones_like(mask).tril()
            wrong = torch.full_like(query, 7.0)
            paged_tree_attention_triton(query, keys, values, table, context_lens, rows, causal, wrong, scale=0.3)
            assert (wrong[rows].double() - ref).abs().max() > 1e-3

    check("2x3", 4, 2, 32, [1, 17, 40])
    check([[0], [1], [2], [0, 0], [0, 1], [2, 0]], 2, 2, 40, [31, 5])
    check("1x4", 6, 1, 64, [50])
    check("3x2", 2, 1, 128, [16, 33], transposed=True)
    check("2x5", 4, 2, 32, [3, 70, 20], level=(3, 6))  # drafting: depth-2 nodes over keys 0..6
    check("2x3", 4, 2, 32, [9, 48], cut=[5, 3])  # trees the scheduler cut short
    check("2x3", 4, 2, 64, [12, 37], dtype=torch.float16, atol=2e-3)
    # Keys split across programs (flash-decoding), merged by log-sum-exp; a split may see no key.
    check("2x3", 4, 2, 32, [1, 17, 90], splits=3)
    check("2x5", 4, 2, 32, [3, 70, 20], level=(3, 6), splits=4)
    check("2x3", 4, 2, 32, [9, 48], cut=[5, 3], splits=5)

    # One mask per request (context-aware trees): each request's rows under its own tree.
    from vllm_univer.core.tree_batch import TreeBatch

    parent = torch.tensor([[-1, 0, 0, 1, 1, 2, 3], [-1, 0, 0, 2, 2, 1, -1], [-1, 0, -1, 1, -1, -1, -1]])
    own = TreeBatch(parent, (1, 2, 3, 1), 2).ancestor_mask
    context = torch.tensor([4, 40, 19])
    table = torch.randperm(BLOCKS, generator=gen)[:12].view(3, 4).int()
    rows = torch.arange(3 * 7).view(3, 7)
    (keys, values), query = paged_cache(2, 32, torch.float32, False), torch.randn(21, 4, 32, generator=gen)
    for splits in (1, 2):
        output = torch.full_like(query, 7.0)
        paged_tree_attention_triton(query, keys, values, table, context, rows, own, output, scale=0.3,
                                    max_context_len=40, num_splits=splits)
        positions = context.unsqueeze(1) + torch.arange(7)
        ref = tree_attention(query[rows].double(), gather_paged(keys, table, positions).double(),
                             gather_paged(values, table, positions).double(), keys.double(), values.double(),
                             table, context, own, scale=0.3)
        torch.testing.assert_close(output[rows].double(), ref, atol=2e-5, rtol=2e-5)
        shared = torch.full_like(query, 7.0)  # the first request's mask for all: another answer
        paged_tree_attention_triton(query, keys, values, table, context, rows, own[0], shared, scale=0.3)
        assert (shared[rows].double() - ref).abs().max() > 1e-3

    # One launch prepared for a forward serves each of its layers (own query, cache and
    # output; shared rows, masks, block table and split buffers): every layer's rows exact.
    from vllm_univer.integration.attention.triton_paged_tree_attention import PagedTreeAttention

    tree = TreeSpec.parse("2x3")
    n, context = tree.num_nodes + 1, torch.tensor([5, 70])
    table = torch.randperm(BLOCKS, generator=gen)[:12].view(2, 6).int()
    rows = torch.arange(2 * n).view(2, n)
    valid = torch.arange(n).unsqueeze(0) < torch.tensor([[n], [4]])
    layers = [(paged_cache(2, 32, torch.float32, False), torch.randn(2 * n, 4, 32, generator=gen)) for _ in range(3)]
    for splits in (1, 3):
        outputs = [torch.full_like(q, 7.0) for _, q in layers]
        (keys, values), query = layers[0]
        attention = PagedTreeAttention(query, keys, values, table, context, rows, tree.ancestor_mask, outputs[0],
                                       scale=0.3, row_valid=valid, max_context_len=70, num_splits=splits)
        for ((keys, values), query), output in zip(layers, outputs):
            attention(query, keys, values, output)
        for ((keys, values), query), output in zip(layers, outputs):
            positions = context.unsqueeze(1) + torch.arange(n)
            ref = tree_attention(query[rows].double(), gather_paged(keys, table, positions).double(),
                                 gather_paged(values, table, positions).double(), keys.double(), values.double(),
                                 table, context, tree.ancestor_mask, scale=0.3)
            torch.testing.assert_close(output[rows][valid].double(), ref[valid], atol=2e-5, rtol=2e-5)
            assert (output[rows][~valid] == 7.0).all()
    print("OK")
""")


def test_triton_paged_tree_attention_equals_reference_in_interpreter():
    run_interpreted(CHECK, "OK", timeout=900)


VLLM_BAR = textwrap.dedent("""
    import sys
    import torch
    import triton
    import triton.language as tl
    import triton.language.extra.libdevice as tldevice
    import vllm.triton_utils as triton_utils

    # vLLM's CPU build hides Triton (no CPU driver); its kernel runs in the interpreter with the real module.
    triton_utils.triton, triton_utils.tl, triton_utils.tldevice = triton, tl, tldevice
    from benchmarks.vllm_attention import chain_matches_triton_attn

    gen = torch.Generator().manual_seed(0)
    err = chain_matches_triton_attn(torch.device("cpu"), torch.float32, gen, reqs=2, context=40, t=6)
    assert err < 1e-5, err
    print("OK", err)
""")


def test_chain_equals_vllm_triton_attn_kernel_in_interpreter():
    """What gpu_check times tree attention against (vLLM's TRITON_ATTN kernel, causal,
    same rows and contexts) computes what the package's kernel computes on a chain:
    the comparison is like for like, and its call of vLLM's kernel is right."""
    pytest.importorskip("vllm")
    run_interpreted(VLLM_BAR, "OK", timeout=900)
