"""Tree attention over a paged KV cache against a plain masked reference, and
compaction of the accepted path's KV."""

import math

import pytest
import torch

from vllm_univer import TreeSpec
from vllm_univer.integration.attention.kv_compaction import accepted_path_moves, move_paged_kv
from vllm_univer.integration.attention.tree_attention import (
    merge_attention_states,
    paged_context_attention,
    tree_attention,
    tree_self_attention,
)


def _paged_batch(context_lens, tree, hq, hkv, dh, block_size, seed=0, dtype=torch.float32):
    """Random contexts in a paged cache with shuffled blocks, plus tree tokens."""
    gen = torch.Generator().manual_seed(seed)
    batch, t = len(context_lens), tree.num_nodes + 1
    max_blocks = max(math.ceil(c / block_size) for c in context_lens) + 1
    num_blocks = batch * max_blocks + 3
    perm = torch.randperm(num_blocks, generator=gen)
    block_table = perm[: batch * max_blocks].view(batch, max_blocks).int()
    k_cache = torch.randn(num_blocks, block_size, hkv, dh, generator=gen, dtype=dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, dh, generator=gen, dtype=dtype)
    q = torch.randn(batch, t, hq, dh, generator=gen, dtype=dtype)
    tk = torch.randn(batch, t, hkv, dh, generator=gen, dtype=dtype)
    tv = torch.randn(batch, t, hkv, dh, generator=gen, dtype=dtype)
    return q, tk, tv, k_cache, v_cache, block_table, torch.tensor(context_lens)


def _reference(q, tk, tv, k_cache, v_cache, block_table, context_lens, mask, scale):
    """Per request, per head: softmax over [context keys, tree keys] with the tree mask, float64."""
    batch, t, hq, dh = q.shape
    hkv = tk.shape[2]
    block_size = k_cache.shape[1]
    out = torch.zeros(batch, t, hq, dh, dtype=torch.float64)
    for b in range(batch):
        L = int(context_lens[b])
        pos = torch.arange(L)
        blocks = block_table[b, pos // block_size].long()
        ck = k_cache[blocks, pos % block_size].double()
        cv = v_cache[blocks, pos % block_size].double()
        keys = torch.cat([ck, tk[b].double()])
        vals = torch.cat([cv, tv[b].double()])
        visible = torch.cat([torch.ones(t, L, dtype=torch.bool), mask], 1)
        for h in range(hq):
            g = h // (hq // hkv)
            s = q[b, :, h].double() @ keys[:, g].T * scale
            s = s.masked_fill(~visible, float("-inf"))
            out[b, :, h] = s.softmax(-1) @ vals[:, g]
    return out


@pytest.mark.parametrize("shape", ["2x3", "3x2", "1x5", "irregular"])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 1)])
def test_tree_attention_matches_reference(shape, hq, hkv):
    tree = (
        TreeSpec.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (0, 0, 0), (2, 0)])
        if shape == "irregular"
        else TreeSpec.parse(shape)
    )
    context_lens = [0, 5, 16, 37]  # empty, inside one block, exactly one block, across blocks
    q, tk, tv, kc, vc, bt, cl = _paged_batch(context_lens, tree, hq, hkv, 32, block_size=16)
    scale = 0.2
    out = tree_attention(q, tk, tv, kc, vc, bt, cl, tree.ancestor_mask, scale=scale)
    ref = _reference(q, tk, tv, kc, vc, bt, cl, tree.ancestor_mask, scale)
    assert out.dtype == q.dtype
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def test_chain_tree_is_causal_attention():
    """On a chain, tree positions are consecutive and the ancestor mask is causal:
    the result equals plain causal attention over context + chain."""
    tree = TreeSpec.parse("1x4")
    q, tk, tv, kc, vc, bt, cl = _paged_batch([7, 20], tree, 2, 2, 32, block_size=8, seed=3)
    out = tree_attention(q, tk, tv, kc, vc, bt, cl, tree.ancestor_mask)
    causal = torch.tril(torch.ones(5, 5, dtype=torch.bool))
    assert torch.equal(tree.ancestor_mask, causal)
    ref = _reference(q, tk, tv, kc, vc, bt, cl, causal, 1 / math.sqrt(32))
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def test_merge_of_two_halves_equals_whole():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 3, 2, 16, generator=gen)
    k = torch.randn(1, 10, 2, 16, generator=gen)
    v = torch.randn(1, 10, 2, 16, generator=gen)
    full = torch.ones(3, 10, dtype=torch.bool)
    whole, lse = tree_self_attention(q, k, v, full)
    a, la = tree_self_attention(q, k[:, :4], v[:, :4], full[:, :4])
    b, lb = tree_self_attention(q, k[:, 4:], v[:, 4:], full[:, 4:])
    merged, lse_m = merge_attention_states(a, la, b, lb)
    torch.testing.assert_close(merged, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_m, lse, atol=1e-5, rtol=1e-5)


def test_empty_context_is_pure_tree_attention():
    tree = TreeSpec.parse("2x2")
    q, tk, tv, kc, vc, bt, cl = _paged_batch([0, 0], tree, 2, 2, 32, block_size=16)
    out, lse = paged_context_attention(q, kc, vc, bt, cl)
    assert torch.isneginf(lse).all() and (out == 0).all()
    full = tree_attention(q, tk, tv, kc, vc, bt, cl, tree.ancestor_mask)
    only_tree, _ = tree_self_attention(q, tk, tv, tree.ancestor_mask)
    torch.testing.assert_close(full, only_tree)


@pytest.mark.parametrize("block_size", [4, 16])
def test_accepted_path_kv_moves_to_consecutive_slots(block_size):
    tree = TreeSpec.parse("2x3")
    gen = torch.Generator().manual_seed(1)
    batch, n1 = 3, tree.num_nodes + 1
    context_lens = torch.tensor([3, 14, 30])
    max_blocks = (30 + n1) // block_size + 2
    num_blocks = batch * max_blocks
    block_table = torch.randperm(num_blocks, generator=gen)[: batch * max_blocks].view(batch, max_blocks)
    cache = torch.randn(num_blocks, block_size, 2, 8, generator=gen)
    before = cache.clone()
    end_nodes = torch.tensor([13, 0, 6])  # depth 3 path, root only, depth 2 path
    path = tree.ancestors[end_nodes]
    request, src, dst = accepted_path_moves(context_lens, path)
    move_paged_kv(cache, block_table, request, src, dst)

    def at(c, b, pos):
        return c[block_table[b, pos // block_size], pos % block_size]

    for b in range(batch):
        L = int(context_lens[b])
        nodes = [n for n in path[b].tolist() if n >= 0]
        for j, node in enumerate(nodes, start=1):
            assert torch.equal(at(cache, b, L + j), at(before, b, L + node))
        for pos in range(L + 1):  # context and the root are untouched
            assert torch.equal(at(cache, b, pos), at(before, b, pos))


def test_accepted_path_kv_moves_in_every_cache_of_a_list():
    """One call moves the path in every layer's K and V: contiguous caches,
    strided views (head-major layouts) and caches of another block size (their
    own slots) alike, each exactly as a call on that cache alone."""
    tree = TreeSpec.parse("2x3")
    gen = torch.Generator().manual_seed(2)
    context_lens = torch.tensor([5, 17])
    path = tree.ancestors[torch.tensor([14, 5])]
    request, src, dst = accepted_path_moves(context_lens, path)
    table = torch.randperm(16, generator=gen)[:8].view(2, 4)
    caches = []
    for block_size, head_major in ((8, False), (8, True), (16, False)):
        data = torch.randn(16, 3, block_size, 4, generator=gen)  # [blocks, heads, block, dim]
        caches.append(data.transpose(1, 2) if head_major else data.transpose(1, 2).contiguous())
    expected = [cache.clone() for cache in caches]
    for cache in expected:
        move_paged_kv(cache, table, request, src, dst)
    assert not torch.equal(expected[0], caches[0])  # the paths do move entries
    move_paged_kv(caches, table, request, src, dst)
    for got, want in zip(caches, expected):
        assert torch.equal(got, want)


def test_per_request_masks_equal_each_requests_own():
    """Context-aware trees: one ancestor mask per request ([R, Tq, Tk]) gives each
    request what its own mask alone gives (the CPU key mask and the reference)."""
    from vllm_univer.core.tree_batch import TreeBatch
    from vllm_univer.integration.attention.tree_attention import cached_tree_key_mask

    parent = torch.tensor([[-1, 0, 0, 1, 1, 2], [-1, 0, 0, 2, 2, 1], [-1, 0, -1, 1, -1, -1]])
    own = TreeBatch(parent, (1, 2, 3), 2).ancestor_mask
    context = torch.tensor([3, 9, 0])
    both = cached_tree_key_mask(context, own, 20)
    for r in range(3):
        assert torch.equal(both[r], cached_tree_key_mask(context[r : r + 1], own[r], 20)[0])
    assert not torch.equal(both[0], both[1])
