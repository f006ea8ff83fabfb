"""Our views of vLLM's CPU KV cache, and tree attention against vLLM's own CPU
attention kernel (a chain tree is causal attention)."""

import math

import pytest
import torch

vllm_ops = pytest.importorskip("vllm._custom_ops")
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: E402

from vllm_univer import TreeSpec  # noqa: E402
from vllm_univer.integration.kv_cache_views import cpu_kv_views  # noqa: E402
from vllm_univer.kernels import move_paged_kv, tree_attention  # noqa: E402

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


def test_unsupported_isa_is_refused():
    with pytest.raises(NotImplementedError, match="neon"):
        cpu_kv_views(torch.zeros(1, 1, 32, 128), "neon")
