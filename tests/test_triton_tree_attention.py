"""The Triton tree-part kernel equals the PyTorch reference (run by Triton's
interpreter on CPU, in a subprocess so that TRITON_INTERPRET is set before import)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

CHECK = textwrap.dedent("""
    import torch
    from vllm_univer import TreeSpec
    from vllm_univer.kernels.tree_attention import tree_self_attention
    from vllm_univer.kernels.triton_tree_attention import tree_self_attention_triton

    gen = torch.Generator().manual_seed(0)
    cases = [("2x3", 4, 2, 32), ([[0], [1], [2], [0, 0], [0, 1], [2, 0]], 2, 2, 40), ("1x4", 4, 1, 64),
             ("3x2", 2, 1, 128)]
    for spec, q_heads, kv_heads, head_size in cases:
        tree = TreeSpec.parse(spec)
        t = tree.num_nodes + 1
        q = torch.randn(3, t, q_heads, head_size, generator=gen)
        k = torch.randn(3, t, kv_heads, head_size, generator=gen)
        v = torch.randn(3, t, kv_heads, head_size, generator=gen)
        ref_out, ref_lse = tree_self_attention(q, k, v, tree.ancestor_mask, scale=0.2)
        out, lse = tree_self_attention_triton(q, k, v, tree.ancestor_mask, scale=0.2)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
        # A wrong mask (siblings visible) must not pass.
        wrong, _ = tree_self_attention_triton(q, k, v, torch.ones_like(tree.ancestor_mask).tril(), scale=0.2)
        assert (wrong - ref_out).abs().max() > 1e-3 or tree.is_chain
    print("OK")
""")


def test_triton_tree_part_equals_reference_in_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
