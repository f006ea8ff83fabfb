"""The drafter's q rows on CUDA (``core/kernels/triton_temperature_softmax.py``), run
by Triton's interpreter on CPU: softmax(logits / T) over the allowed tokens equals
the PyTorch path's (``TreeDrafter._level_rows`` off CUDA) for float32 and bfloat16
logits, per-request temperatures, banned tokens, -inf logits, two vocabulary
blocks, written into a slice of the q buffer and nowhere else.
"""

from __future__ import annotations

import textwrap

import pytest
from triton_interpreter import run_interpreted

pytest.importorskip("triton")

CHECK = textwrap.dedent("""
    import torch
    from vllm_univer.integration.sampling.target_probs import softmax_
    from vllm_univer.core.kernels.triton_temperature_softmax import temperature_softmax

    gen = torch.Generator().manual_seed(0)
    for vocab, dtype in ((7, torch.float32), (300, torch.bfloat16), (5000, torch.float32)):
        reqs, width = 3, 2
        logits = (torch.randn(reqs, width, vocab, generator=gen) * 4).to(dtype)
        logits[0, 1, : vocab // 2] = float("-inf")  # a row with half its tokens impossible
        temperature = torch.tensor([1.0, 0.3, 1.7])
        for banned in (None, torch.rand(reqs, vocab, generator=gen) < 0.4):
            q = torch.full((reqs, 5, vocab), 7.0)
            out = q[:, 2:4]
            temperature_softmax(logits, temperature, banned, out)
            want = logits.float() / temperature.view(-1, 1, 1)
            if banned is not None:
                want = want.masked_fill(banned.unsqueeze(1), float("-inf"))
            want = softmax_(want.contiguous())
            torch.testing.assert_close(out, want, atol=1e-7, rtol=2e-6)
            assert torch.isfinite(out).all() and (out[want == 0] == 0).all()
            assert (q[:, :2] == 7.0).all() and (q[:, 4:] == 7.0).all()
    print("SOFTMAX OK")
""")


def test_fused_temperature_softmax_equals_the_pytorch_rows_in_interpreter():
    run_interpreted(CHECK, "SOFTMAX OK")
