"""Our views of vLLM's CPU KV cache, and tree attention against vLLM's own CPU
attention kernel (a chain tree is causal attention)."""

import math
import types

import pytest
import torch

vllm_ops = pytest.importorskip("vllm._custom_ops")
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: E402

from vllm_univer import TreeSpec  # noqa: E402
from vllm_univer.integration.attention.cpu_tree_attention import forward_tree_rows  # noqa: E402
from vllm_univer.integration.attention.kv_cache_views import cpu_kv_views, gather_cpu_blocks  # noqa: E402
from vllm_univer.integration.attention.kv_compaction import move_paged_kv  # noqa: E402
from vllm_univer.integration.attention.tree_attention import tree_attention  # noqa: E402
from vllm_univer.integration.attention.tree_attention_plan import TreeAttentionPlan  # noqa: E402

BLOCK, HEADS, DH = 32, 2, 64


def _write(kv, keys, values, slots, isa):
    nb, h, bs, _ = kv.shape
    kc, vc = kv.view(nb, h, 2 * bs, -1).chunk(2, dim=2)
    vllm_ops.cpu_attn_reshape_and_cache(
        keys, values, kc, vc, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto"
    )


def _require_layout(isa: str, block: int = BLOCK, dh: int = DH) -> None:
    """Skip unless this machine's vLLM writes ``isa``'s cache layout: vec where vLLM
    picks it for float32 at this block and head size; amx (written by plain stores)
    on any x86 build with its AMX code."""
    if isa == "vec":
        picked = _get_attn_isa(torch.float32, block, dh)
        if picked != "vec":
            pytest.skip(f"attention ISA {picked!r} on this machine")
        return
    try:
        _write(
            torch.zeros(1, 1, BLOCK, 2 * DH, dtype=torch.bfloat16),
            *[torch.zeros(1, 1, DH).bfloat16()] * 2,
            torch.tensor([0]),
            "amx",
        )
    except RuntimeError as error:  # a build without the amx kernels (non-x86)
        pytest.skip(f"this vLLM build does not write the amx layout: {error}")


def _layouts():
    """(isa, dtype) pairs whose layout vLLM writes here: vec in float32 and bfloat16, amx in bfloat16."""
    return [("vec", torch.float32), ("vec", torch.bfloat16), ("amx", torch.bfloat16)]


@pytest.mark.parametrize("isa,dtype", _layouts())
@pytest.mark.parametrize("block,dh", [(32, 64), (128, 128)])
def test_views_read_what_vllm_wrote(isa, dtype, block, dh):
    _require_layout(isa, block, dh)
    kv = torch.zeros(4, HEADS, block, 2 * dh, dtype=dtype)
    t = 3 * block - 5
    k, v = torch.randn(t, HEADS, dh).to(dtype), torch.randn(t, HEADS, dh).to(dtype)
    slots = torch.randperm(4 * block)[:t]
    _write(kv, k, v, slots, isa)
    keys, values = cpu_kv_views(kv, isa)
    assert keys.shape == values.shape == (4, block, HEADS, dh)
    assert torch.equal(keys[slots // block, slots % block], k)
    assert torch.equal(values[slots // block, slots % block], v)
    # Whole blocks (what gather_context reads) equal the same entries read one by one.
    every = torch.arange(4).repeat_interleave(block), torch.arange(block).repeat(4)
    for cache in (keys, values):
        assert torch.equal(cache[torch.arange(4)], cache[every].view(4, block, HEADS, dh))
    # Writes through the views land where vLLM reads: write back, compare the raw cache.
    again = torch.zeros_like(kv)
    keys2, values2 = cpu_kv_views(again, isa)
    keys2[slots // block, slots % block] = k
    values2[slots // block, slots % block] = v
    assert torch.equal(again, kv)


@pytest.mark.parametrize("isa,dtype", _layouts())
def test_kv_moves_through_views_are_seen_by_vllm_kernel(isa, dtype):
    """Move entries with move_paged_kv on our views; vLLM's kernel reads the moved data."""
    _require_layout(isa)
    kv = torch.zeros(3, HEADS, BLOCK, 2 * DH, dtype=dtype)
    k, v = torch.randn(40, HEADS, DH).to(dtype), torch.randn(40, HEADS, DH).to(dtype)
    _write(kv, k, v, torch.arange(40), isa)
    keys, values = cpu_kv_views(kv, isa)
    table = torch.tensor([[0, 1, 2]])
    req, src, dst = torch.tensor([0, 0]), torch.tensor([35, 38]), torch.tensor([33, 34])
    for cache in (keys, values):
        move_paged_kv(cache, table, req, src, dst)
    assert torch.equal(keys[torch.tensor([1]), torch.tensor([1])][0], k[35])
    assert torch.equal(values[torch.tensor([1]), torch.tensor([2])][0], v[38])
    assert torch.equal(keys[torch.tensor([1]), torch.tensor([0])][0], k[32])  # untouched


@pytest.mark.parametrize("context_lens", [[5, 40], [31, 64], [0, 3]])
@pytest.mark.parametrize("isa,dtype", [("vec", torch.float32), ("amx", torch.bfloat16)])
def test_chain_tree_attention_equals_vllm_causal_kernel(context_lens, isa, dtype):
    _require_layout(isa)
    if isa == "amx" and not (torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx()):
        pytest.skip("vLLM's amx attention kernel needs a CPU with AMX")
    tree = TreeSpec.parse("1x4")
    t = tree.num_nodes + 1
    gen = torch.Generator().manual_seed(sum(context_lens))
    batch = len(context_lens)
    max_blocks = max(math.ceil((c + t) / BLOCK) for c in context_lens)
    num_blocks = batch * max_blocks
    kv = torch.zeros(num_blocks, HEADS, BLOCK, 2 * DH, dtype=dtype)
    block_table = torch.randperm(num_blocks, generator=gen).view(batch, max_blocks).int()
    q = torch.randn(batch, t, HEADS * 2, DH, generator=gen).to(dtype)  # GQA: 4 query heads over 2 kv heads
    k = [torch.randn(c + t, HEADS, DH, generator=gen).to(dtype) for c in context_lens]
    v = [torch.randn(c + t, HEADS, DH, generator=gen).to(dtype) for c in context_lens]
    for b, c in enumerate(context_lens):
        pos = torch.arange(c + t)
        slots = block_table[b, pos // BLOCK].long() * BLOCK + pos % BLOCK
        _write(kv, k[b], v[b], slots, isa)

    # vLLM: causal attention of the last t tokens of each sequence.
    scale = 1 / math.sqrt(DH)
    seq_lens = torch.tensor([c + t for c in context_lens], dtype=torch.int32)
    qsl = torch.arange(0, (batch + 1) * t, t, dtype=torch.int32)
    meta = vllm_ops.cpu_attn_get_scheduler_metadata(
        num_reqs=batch,
        num_heads=HEADS * 2,
        num_kv_heads=HEADS,
        head_dim=DH,
        seq_lens=seq_lens,
        dtype=dtype,
        query_start_loc=qsl,
        causal=True,
        sliding_window_size=-1,
        isa=isa,
        enable_kv_split=False,
    )
    nb, h, bs, _ = kv.shape
    kc, vc = kv.view(nb, h, 2 * bs, -1).chunk(2, dim=2)
    expected = torch.empty(batch * t, HEADS * 2, DH, dtype=dtype)
    vllm_ops.cpu_attention_with_kv_cache(
        query=q.reshape(batch * t, HEADS * 2, DH),
        key_cache=kc,
        value_cache=vc,
        output=expected,
        query_start_loc=qsl,
        seq_lens=seq_lens,
        scale=scale,
        causal=True,
        alibi_slopes=None,
        sliding_window=-1,
        block_table=block_table,
        softcap=0.0,
        scheduler_metadata=meta,
        s_aux=None,
    )

    keys, values = cpu_kv_views(kv, isa)
    tree_k = torch.stack([k[b][-t:] for b in range(batch)])
    tree_v = torch.stack([v[b][-t:] for b in range(batch)])
    ours = tree_attention(
        q, tree_k, tree_v, keys, values, block_table, torch.tensor(context_lens), tree.ancestor_mask, scale=scale
    )
    # bfloat16: both kernels multiply bf16 probabilities by bf16 values, each in its own
    # order: a bf16 ulp (2^-8 relative) or two apart.
    tol = {"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(ours.reshape(batch * t, HEADS * 2, DH), expected, **tol)


def test_sampler_moves_kv_through_every_cpu_view():
    """The sampler's choice between the fused (CUDA) and per-cache KV moves reads only
    ``device`` of a cache, so vLLM's amx layout (a ``TiledPagedCache``, not a tensor)
    takes the per-cache moves on any CPU (it used to read ``is_cuda``: bfloat16 serving
    on AMX CPUs failed at the first accepted path)."""
    from vllm_univer.integration.attention.kv_cache_views import TiledPagedCache
    from vllm_univer.integration.tree_sampler import _fused_kv_moves

    tiled = TiledPagedCache(torch.zeros(3, BLOCK // 16, 16, HEADS, DH // 2, 2, dtype=torch.bfloat16))
    plain = torch.zeros(3, BLOCK, HEADS, DH)
    assert _fused_kv_moves([tiled, tiled]) is None
    assert _fused_kv_moves([plain, plain]) is None


def test_unsupported_isa_is_refused():
    with pytest.raises(NotImplementedError, match="neon"):
        cpu_kv_views(torch.zeros(1, 1, 32, 128), "neon")


@pytest.mark.parametrize("isa,dtype", _layouts())
@pytest.mark.parametrize("block,dh", [(32, 64), (128, 128)])
def test_gather_cpu_blocks_reads_whole_blocks_in_token_order(isa, dtype, block, dh):
    _require_layout(isa, block, dh)
    kv = torch.randn(6, HEADS, block, 2 * dh).to(dtype)
    keys, values = cpu_kv_views(kv, isa)
    blocks = torch.tensor([[4, 0, 2], [1, 5, 3]], dtype=torch.int32)
    got_k, got_v = gather_cpu_blocks(kv, isa, blocks)
    assert got_k.shape == got_v.shape == (2, 3 * block, HEADS, dh)
    for b in range(2):
        ids = blocks[b].long().repeat_interleave(block), torch.arange(block).repeat(3)
        assert torch.equal(got_k[b], keys[ids])
        assert torch.equal(got_v[b], values[ids])


def _tree_attention_reference(q, k, v, context_lens, mask, scale):
    """float64, per request and head: softmax over the first L cached keys and the
    tree keys at L + k that the mask lets each query see."""
    batch, tq, hq, _ = q.shape
    hkv = k[0].shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b, length in enumerate(context_lens):
        visible = torch.cat([torch.ones(tq, length, dtype=torch.bool), mask], 1)
        keys, vals = k[b][: length + mask.shape[1]].double(), v[b][: length + mask.shape[1]].double()
        for h in range(hq):
            s = (q[b, :, h].double() @ keys[:, h // (hq // hkv)].T * scale).masked_fill(~visible, float("-inf"))
            out[b, :, h] = s.softmax(-1) @ vals[:, h // (hq // hkv)]
    return out


@pytest.mark.parametrize("isa,dtype", _layouts())
@pytest.mark.parametrize("drafting", [False, True])
def test_cpu_backend_tree_rows_equal_reference(isa, dtype, drafting):
    """``cpu_tree_attention.forward_tree_rows`` on a cache vLLM wrote: an irregular tree
    (verification: every node a query row, one request padded) or one drafting level
    (its nodes query the levels above, cached), contexts empty / inside a block /
    across blocks, grouped-query heads."""
    _require_layout(isa)
    tree = TreeSpec.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (0, 0, 0), (2, 0)])
    context_lens = [0, 13, 70]
    tk = tree.num_nodes + 1
    gen = torch.Generator().manual_seed(7)
    max_blocks = max(math.ceil((c + tk) / BLOCK) for c in context_lens) + 1
    num_blocks = 4 * max_blocks + 2
    kv = torch.zeros(num_blocks, HEADS, BLOCK, 2 * DH, dtype=dtype)
    # Rows 1..3 of vLLM's block table are the tree requests; row 0 is another request.
    table = torch.randperm(num_blocks, generator=gen)[: 4 * max_blocks].view(4, max_blocks).int()
    k = [torch.randn(c + tk, HEADS, DH, generator=gen).to(dtype) for c in context_lens]
    v = [torch.randn(c + tk, HEADS, DH, generator=gen).to(dtype) for c in context_lens]
    for b, c in enumerate(context_lens):
        pos = torch.arange(c + tk)
        _write(kv, k[b], v[b], table[b + 1, pos // BLOCK].long() * BLOCK + pos % BLOCK, isa)
    if drafting:  # the nodes at depth 2 query every node above them and themselves
        first, last = 4, 6
        mask = tree.ancestor_mask[first : last + 1, : last + 1]
        k, v = (
            [x[: c + last + 1] for x, c in zip(k, context_lens)],
            [x[: c + last + 1] for x, c in zip(v, context_lens)],
        )
    else:
        mask = tree.ancestor_mask
    tq = mask.shape[0]
    hq = 2 * HEADS
    tokens = len(context_lens) * tq + 2  # two rows of other requests around the tree rows
    query = torch.randn(tokens, hq, DH, generator=gen).to(dtype)
    rows = (2 + torch.arange(len(context_lens) * tq)).view(-1, tq)
    row_valid = None if drafting else torch.ones(rows.shape, dtype=torch.bool)
    if not drafting:  # the last request drafted fewer nodes: its last two rows are padding
        row_valid[-1, -2:] = False
        rows[-1, -2:] = rows[-1, 0]
    plan = TreeAttentionPlan(
        query_rows=rows,
        row_valid=row_valid,
        request_index=torch.tensor([1, 2, 3]),
        context_lens=torch.tensor(context_lens),
        mask=mask,
        covers_all_rows=False,
        max_context_len=max(context_lens),
    )
    impl = types.SimpleNamespace(num_heads=hq, head_size=DH, scale=0.3)
    layer = types.SimpleNamespace(isa=isa)
    output = torch.full((tokens, hq * DH), 7.0, dtype=dtype)
    forward_tree_rows(impl, layer, query, None, None, kv, types.SimpleNamespace(block_table=table), output, plan)
    expected = _tree_attention_reference(query[rows], k, v, context_lens, mask, 0.3)
    got = output.view(tokens, hq, DH)
    tol = {"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    valid = torch.ones(rows.shape, dtype=torch.bool) if row_valid is None else row_valid
    torch.testing.assert_close(got[rows[valid]].double(), expected[valid], **tol)
    untouched = torch.ones(tokens, dtype=torch.bool)
    untouched[rows[valid]] = False
    assert (got[untouched] == 7.0).all()  # other requests' rows (and padding) are left to vLLM
