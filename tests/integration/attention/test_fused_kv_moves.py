"""The one-launch KV moves (``integration/attention/triton_kv_moves.py``), run by Triton's
interpreter on CPU in a subprocess: every cache after ``move_accepted_kv``
equals the cache after ``kv_compaction.move_paged_kv`` (the per-cache gather
and scatter the engine runs on CPU, itself checked against vLLM's attention in
test_kv_cache_views.py), bit for bit, for

* both physical orders of vLLM's CUDA layout, [blocks, H, block_size, 2 Dh] and
  [blocks, block_size, H, 2 Dh], split into K and V views (``standard_kv_views``);
* float32 and bfloat16, head counts and sizes that are not powers of two;
* paths of every kind on a 2x3 tree: ending at the root, full depth, a move that
  overwrites a position an earlier move reads (a_1 = 2 then a_2 -> 2), moves
  that stay in place (a_j = j), a request with context 0; blocks shuffled.

The engine takes this path on CUDA (``TreeVerificationSampler._keep_accepted_kv``,
whose call is checked here too: block table, context lengths, paths).
"""

from __future__ import annotations

import textwrap

import pytest
from triton_interpreter import run_interpreted

pytest.importorskip("triton")

CHECK = textwrap.dedent("""
    import torch
    from vllm_univer import TreeSpec
    from vllm_univer.integration.attention.kv_cache_views import standard_kv_views
    from vllm_univer.integration.attention.kv_compaction import accepted_path_moves, move_paged_kv
    from vllm_univer.integration.attention.triton_kv_moves import move_accepted_kv

    gen = torch.Generator().manual_seed(0)
    tree = TreeSpec.parse("2x3")
    # End nodes: root, depth 1 (node 2), node 3 (a_1 = 1, a_2 = 3), node 6 (a_1 = 2,
    # a_2 = 6: writes 2 after reading it), a full-depth path, another full one.
    ends = torch.tensor([0, 2, 3, 6, 7, 14])
    path = tree.ancestors[ends]
    batch = len(ends)
    context = torch.tensor([5, 0, 31, 17, 1, 40])
    block_size, max_blocks = 8, 8
    block_table = torch.randperm(batch * max_blocks, generator=gen).view(batch, max_blocks).to(torch.int32)
    checked = 0
    for heads, head_dim, physical in ((2, 4, "heads_outer"), (3, 5, "slots_outer"), (1, 16, "heads_outer")):
        for dtype in (torch.float32, torch.bfloat16):
            def layers():
                g = torch.Generator().manual_seed(heads * 100 + head_dim)
                out = []
                for _ in range(3):
                    if physical == "heads_outer":
                        raw = torch.randn(batch * max_blocks, heads, block_size, 2 * head_dim, generator=g)
                    else:
                        raw = torch.randn(batch * max_blocks, block_size, heads, 2 * head_dim, generator=g)
                        raw = raw.transpose(1, 2)  # the same logical [blocks, H, block_size, 2 Dh]
                    out.append(raw.to(dtype))
                return out
            want, got = layers(), layers()
            halves = lambda caches: [h for c in caches for h in standard_kv_views(c, head_dim)]
            request, src, dst = accepted_path_moves(context, path)
            move_paged_kv(halves(want), block_table, request, src, dst)
            move_accepted_kv(halves(got), block_table, context, path)
            for a, b in zip(want, got):
                assert torch.equal(a, b), (heads, head_dim, physical, dtype)
            assert not torch.equal(want[0], layers()[0])  # something moved
            checked += 1
    assert checked == 6

    # The engine's call (TreeVerificationSampler._keep_accepted_kv) on that path.
    from types import SimpleNamespace
    import numpy as np
    from vllm_univer.integration import tree_sampler
    from vllm_univer.integration.attention import triton_kv_moves

    tree_sampler._fused_kv_moves = lambda caches: triton_kv_moves  # CUDA only otherwise
    got = layers()
    # The draft's layers: another shape in the same call (a second launch).
    draft_want = [torch.randn(batch * max_blocks, 1, block_size, 6, generator=gen) for _ in range(2)]
    draft_got = [c.clone() for c in draft_want]
    move_paged_kv([h for c in draft_want for h in standard_kv_views(c, 3)], block_table, request, src, dst)
    sampler = object.__new__(tree_sampler.TreeVerificationSampler)
    sampler.runner = SimpleNamespace(
        input_batch=SimpleNamespace(
            num_computed_tokens_cpu=np.concatenate([context.numpy().astype(np.int32), [99]]),  # a row past the batch
            block_table=[SimpleNamespace(get_cpu_tensor=lambda: torch.cat([block_table, block_table[:1]]))],
        )
    )
    sampler.kv_layers = lambda: [standard_kv_views(c, head_dim) for c in got] + [
        standard_kv_views(c, 3) for c in draft_got
    ]
    sampler._keep_accepted_kv(batch, path)
    for a, b in zip(want + draft_want, got + draft_got):
        assert torch.equal(a, b)
    print("KV MOVES OK")
""")


def test_fused_kv_moves_equal_the_gather_scatter_moves_in_interpreter():
    run_interpreted(CHECK, "KV MOVES OK")
