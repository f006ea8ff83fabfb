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


def _isa():
    isa = _get_attn_isa(torch.float32, BLOCK, DH)
    if isa != "vec":
        pytest.skip(f"attention ISA {isa!r} on this machine")
    return isa


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_views_read_what_vllm_wrote(dtype):
    # bfloat16 in the vec layout everywhere: on AMX CPUs vLLM would pick its amx
    # layout, which tree speculation switches to vec (patches.patch_cpu_attention_isa).
    isa = _isa()
    kv = torch.zeros(4, HEADS, BLOCK, 2 * DH, dtype=dtype)
    t = 70
    k, v = torch.randn(t, HEADS, DH).to(dtype), torch.randn(t, HEADS, DH).to(dtype)
    slots = torch.randperm(4 * BLOCK)[:t]
    _write(kv, k, v, slots, isa)
    keys, values = cpu_kv_views(kv, isa)
    assert torch.equal(keys[slots // BLOCK, slots % BLOCK], k)
    assert torch.equal(values[slots // BLOCK, slots % BLOCK], v)


def test_kv_moves_through_views_are_seen_by_vllm_kernel():
    """Move entries with move_paged_kv on our views; vLLM's kernel reads the moved data."""
    isa = _isa()
    kv = torch.zeros(3, HEADS, BLOCK, 2 * DH)
    k, v = torch.randn(40, HEADS, DH), torch.randn(40, HEADS, DH)
    _write(kv, k, v, torch.arange(40), isa)
    keys, values = cpu_kv_views(kv, isa)
    table = torch.tensor([[0, 1, 2]])
    req, src, dst = torch.tensor([0, 0]), torch.tensor([35, 38]), torch.tensor([33, 34])
    for cache in (keys, values):
        move_paged_kv(cache, table, req, src, dst)
    assert torch.equal(keys[1, 1], k[35]) and torch.equal(values[1, 2], v[38])
    assert torch.equal(keys[1, 0], k[32])  # untouched


@pytest.mark.parametrize("context_lens", [[5, 40], [31, 64], [0, 3]])
def test_chain_tree_attention_equals_vllm_causal_kernel(context_lens):
    isa = _isa()
    tree = TreeSpec.parse("1x4")
    t = tree.num_nodes + 1
    gen = torch.Generator().manual_seed(sum(context_lens))
    batch = len(context_lens)
    max_blocks = max(math.ceil((c + t) / BLOCK) for c in context_lens)
    num_blocks = batch * max_blocks
    kv = torch.zeros(num_blocks, HEADS, BLOCK, 2 * DH)
    block_table = torch.randperm(num_blocks, generator=gen).view(batch, max_blocks).int()
    q = torch.randn(batch, t, HEADS * 2, DH, generator=gen)  # GQA: 4 query heads over 2 kv heads
    k = [torch.randn(c + t, HEADS, DH, generator=gen) for c in context_lens]
    v = [torch.randn(c + t, HEADS, DH, generator=gen) for c in context_lens]
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
        dtype=torch.float32,
        query_start_loc=qsl,
        causal=True,
        sliding_window_size=-1,
        isa=isa,
        enable_kv_split=False,
    )
    nb, h, bs, _ = kv.shape
    kc, vc = kv.view(nb, h, 2 * bs, -1).chunk(2, dim=2)
    expected = torch.empty(batch * t, HEADS * 2, DH)
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
    torch.testing.assert_close(ours.reshape(batch * t, HEADS * 2, DH), expected, atol=1e-5, rtol=1e-4)


def test_unsupported_isa_is_refused():
    with pytest.raises(NotImplementedError, match="amx"):
        cpu_kv_views(torch.zeros(1, 1, 32, 128), "amx")
