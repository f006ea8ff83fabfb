"""The CUDA backends' tree-attention hook, run on CPU.

vLLM's FlashAttention and Triton attention implementations are constructed as
the engine builds them, their ``forward`` patched by the plugin, and called with
a forward's metadata carrying a ``TreeAttentionPlan``: the tree rows must equal
the PyTorch reference (our Triton kernel runs in Triton's interpreter), the
ordinary rows must be vLLM's kernel's (a PyTorch stand-in here: vLLM's own Triton
kernels need a GPU), and the cache must be read through vLLM's own layout.
"""

from __future__ import annotations

import textwrap

import pytest
from triton_interpreter import run_interpreted

pytest.importorskip("triton")
pytest.importorskip("vllm")

CHECK = textwrap.dedent("""
    import types
    import torch
    from vllm.v1.attention.backends import triton_attn
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    from vllm_univer import TreeSpec
    from vllm_univer.integration import patches
    from vllm_univer.integration.attention.kv_cache_views import standard_kv_views
    from vllm_univer.integration.attention.tree_attention_plan import TreeAttentionPlan, check_layer_supported
    from vllm_univer.integration.attention.tree_attention import gather_paged, tree_attention

    patches.patch_attention_forwards()
    gen = torch.Generator().manual_seed(0)
    HQ, HKV, DH, BS, NB = 4, 2, 32, 16, 40
    tree = TreeSpec.parse("2x3")
    t = tree.num_nodes + 1

    # Batch: request 0 decodes one ordinary token, requests 1 and 2 verify trees.
    context = torch.tensor([25, 17, 40])
    query_len = torch.tensor([1, t, t])
    seq_lens = context + query_len
    starts = torch.cat([torch.zeros(1, dtype=torch.long), query_len.cumsum(0)])
    tokens = int(starts[-1])
    table = torch.randperm(NB, generator=gen)[:3 * 5].view(3, 5).int()
    kv_cache = torch.randn(NB, HKV, BS, 2 * DH, generator=gen)  # vLLM 0.32's logical layout
    keys, values = standard_kv_views(kv_cache, DH)
    query = torch.randn(tokens, HQ, DH, generator=gen)
    rows = torch.stack([torch.arange(int(starts[r]), int(starts[r]) + t) for r in (1, 2)])
    plan = TreeAttentionPlan(query_rows=rows, row_valid=None, request_index=torch.tensor([1, 2]),
                             context_lens=context[1:], mask=tree.ancestor_mask,
                             covers_all_rows=False, max_context_len=40)

    def causal_stand_in(q, k, v, out, cu_seqlens_q, seqused_k, block_table, softmax_scale, **_):
        # vLLM's unified_attention for ordinary rows: causal attention over the paged cache.
        for r in range(len(seqused_k)):
            a, b = int(cu_seqlens_q[r]), int(cu_seqlens_q[r + 1])
            n = int(seqused_k[r])
            pos = torch.arange(n).unsqueeze(0)
            kk, vv = gather_paged(k, block_table[r:r + 1], pos), gather_paged(v, block_table[r:r + 1], pos)
            qpos = torch.arange(n - (b - a), n)
            mask = (pos[0].unsqueeze(0) <= qpos.unsqueeze(1)).unsqueeze(0)
            groups = HQ // HKV
            s = torch.einsum("thd,shd->hts", q[a:b], kk[0].repeat_interleave(groups, 1)) * softmax_scale
            s = s.masked_fill(~mask, float("-inf"))
            out[a:b] = torch.einsum("hts,shd->thd", s.softmax(-1), vv[0].repeat_interleave(groups, 1))

    triton_attn.unified_attention = causal_stand_in
    metadata = triton_attn.TritonAttentionMetadata(
        num_actual_tokens=tokens, max_query_len=t, query_start_loc=starts.int(), max_seq_len=int(seq_lens.max()),
        seq_lens=seq_lens.int(), block_table=table, slot_mapping=torch.zeros(tokens, dtype=torch.long),
        seq_threshold_3D=0, num_par_softmax_segments=0, softmax_segm_output=None, softmax_segm_max=None,
        softmax_segm_expsum=None, causal=True)
    metadata.tree_plan = plan
    layer = types.SimpleNamespace(_q_scale=torch.ones(1), _k_scale=torch.ones(1), _v_scale=torch.ones(1))
    scale = 0.2

    def reference_tree_rows():
        pos = context[1:].unsqueeze(1) + torch.arange(t)
        tk, tv = gather_paged(keys, table[1:], pos), gather_paged(values, table[1:], pos)
        return tree_attention(query[rows].double(), tk.double(), tv.double(), keys.double(), values.double(),
                              table[1:], context[1:], tree.ancestor_mask, scale=scale)

    # Triton backend, mixed batch: ordinary row from vLLM's path, tree rows exact.
    impl = TritonAttentionImpl(HQ, DH, scale, HKV, None, None, "auto")
    check_layer_supported(impl)
    output = torch.full((tokens, HQ, DH), float("nan"))
    impl.forward(layer, query, None, None, kv_cache, metadata, output)
    torch.testing.assert_close(output[rows].double(), reference_tree_rows(), atol=2e-5, rtol=2e-5)
    ordinary = torch.full((1, HQ, DH), float("nan"))
    causal_stand_in(query[:1], keys, values, ordinary, torch.tensor([0, 1]), seq_lens[:1], table[:1], scale)
    torch.testing.assert_close(output[:1], ordinary)
    # Without the plan the patched forward is vLLM's: tree rows come out causal, i.e. different.
    metadata.tree_plan = None
    causal = torch.zeros(tokens, HQ, DH)
    impl.forward(layer, query, None, None, kv_cache, metadata, causal)
    assert (causal[rows].double() - reference_tree_rows()).abs().max() > 1e-3

    # FlashAttention backend, a drafting forward (every row a tree row: vLLM's kernel is skipped).
    flash = FlashAttentionImpl(HQ, DH, scale, HKV, None, None, "auto")
    check_layer_supported(flash)
    only_tree = types.SimpleNamespace(block_table=table, tree_plan=TreeAttentionPlan(
        query_rows=rows, row_valid=None, request_index=torch.tensor([1, 2]), context_lens=context[1:],
        mask=tree.ancestor_mask, covers_all_rows=True, max_context_len=40))
    output = torch.zeros(tokens, HQ * DH)  # the flat layout some callers pass
    flash.forward(layer, query, None, None, kv_cache, only_tree, output)
    torch.testing.assert_close(output.view(tokens, HQ, DH)[rows].double(), reference_tree_rows(), atol=2e-5,
                               rtol=2e-5)
    assert (output[:1] == 0).all()

    # A tree cut short (row_valid): only its valid rows are written; the plan's
    # per-forward launch serves the next layer too.
    valid = torch.arange(t).unsqueeze(0) < torch.tensor([[t], [3]])
    cut = TreeAttentionPlan(query_rows=rows, row_valid=valid, request_index=torch.tensor([1, 2]),
                            context_lens=context[1:], mask=tree.ancestor_mask, covers_all_rows=True,
                            max_context_len=40)
    for _ in range(2):
        output = torch.zeros(tokens, HQ, DH)
        flash.forward(layer, query, None, None, kv_cache, types.SimpleNamespace(block_table=table, tree_plan=cut),
                      output)
        torch.testing.assert_close(output[rows][valid].double(), reference_tree_rows()[valid], atol=2e-5,
                                   rtol=2e-5)
        assert (output[rows][~valid] == 0).all()
    # One launch prepared for the forward (block table rows, int8 masks, strides), reused by the next layer.
    assert len(cut._derived) == 1, cut._derived

    # Unsupported layer features are refused by name.
    for kwargs, words in (({"sliding_window": 8}, "sliding windows"), ({"kv_cache_dtype": "fp8"}, "fp8"),
                          ({"logits_soft_cap": 30.0}, "soft-capping")):
        args = dict(num_heads=HQ, head_size=DH, scale=scale, num_kv_heads=HKV, alibi_slopes=None,
                    sliding_window=None, kv_cache_dtype="auto")
        args.update(kwargs)
        try:
            check_layer_supported(TritonAttentionImpl(**args))
        except NotImplementedError as e:
            assert words in str(e), e
        else:
            raise AssertionError(f"{kwargs} not refused")
    print("OK")
""")


def test_cuda_backends_tree_rows_on_cpu():
    run_interpreted(CHECK, "OK", timeout=900)


def test_unknown_backend_is_refused():
    from vllm_univer.integration.attention.tree_attention_plan import check_layer_supported

    class FlashInferImpl:
        pass

    with pytest.raises(NotImplementedError, match="FLASH_ATTN"):
        check_layer_supported(FlashInferImpl())
