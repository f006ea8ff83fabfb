"""The draft rows q = softmax(logits / T) over the allowed tokens, in one launch.

The drafter writes each level's q rows into the step's q buffer (the verifier
reads them next step). In PyTorch that is copy, divide, mask, max, subtract,
exp, sum, divide: eight launches and about twelve passes over [R, W, V]; here
one program per row reads the logits twice (an online max and sum, then the
normalised write) and writes q once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import FLOATS, expect
from .triton_rows import block_size


def temperature_softmax(
    logits: torch.Tensor, temperature: torch.Tensor, banned: torch.Tensor | None, out: torch.Tensor
) -> torch.Tensor:
    """out <- softmax(logits / T) per row, banned tokens (and -inf logits) at 0.

    logits: [R, W, V] (any float dtype, V contiguous); temperature: float32 [R]
    (> 0); banned: bool [R, V] or None; out: float32 [R, W, V] (V contiguous,
    e.g. a slice of the q buffer). Returns ``out``.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits: expected shape [R, W, V], got {list(logits.shape)}")
    reqs, width, vocab = logits.shape
    expect("logits", logits, (reqs, width, vocab), FLOATS, last_contiguous=True)
    expect("temperature", temperature, (reqs,), torch.float32, device=logits.device)
    expect("banned", banned, (reqs, vocab), torch.bool, last_contiguous=True)
    expect("out", out, (reqs, width, vocab), torch.float32, last_contiguous=True, device=logits.device)
    if reqs * width == 0:
        return out
    banned_flags = banned.view(torch.int8) if banned is not None else None
    _temperature_softmax[(reqs * width,)](
        logits_ptr=logits,  # [R, W, V] any float dtype, V contiguous
        temperature_ptr=temperature,  # [R] float32, > 0
        banned_ptr=banned_flags,  # [R, V] int8: 1 = token banned (read if HAS_BANNED)
        out_ptr=out,  # [R, W, V] float32, written: softmax(logits / T) off the banned tokens
        width=width,  # W: rows per request
        vocab=vocab,  # V
        stride_lr=logits.stride(0),
        stride_lw=logits.stride(1),
        stride_or=out.stride(0),
        stride_ow=out.stride(1),
        stride_br=banned.stride(0) if banned is not None else 0,
        HAS_BANNED=banned is not None,
        BLOCK_V=block_size(vocab),
    )
    return out


@triton.jit
def _temperature_softmax(
    logits_ptr,  # [R, W, V] any float dtype, V contiguous
    temperature_ptr,  # [R] float32, > 0
    banned_ptr,  # [R, V] int8: 1 = token banned (read if HAS_BANNED)
    out_ptr,  # [R, W, V] float32, written: softmax(logits / T) off the banned tokens
    width,  # W: rows per request
    vocab,  # V
    stride_lr,
    stride_lw,
    stride_or,
    stride_ow,
    stride_br,
    HAS_BANNED: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    req = row // width
    slot = row % width
    temperature = tl.load(temperature_ptr + req)
    src = logits_ptr + req.to(tl.int64) * stride_lr + slot * stride_lw
    dst = out_ptr + req.to(tl.int64) * stride_or + slot * stride_ow
    offsets = tl.arange(0, BLOCK_V)

    top = tl.full([], float("-inf"), tl.float32)
    total = tl.full([], 0.0, tl.float32)
    for start in range(0, vocab, BLOCK_V):
        v = start + offsets
        x = tl.load(src + v, mask=v < vocab, other=float("-inf")).to(tl.float32) / temperature
        if HAS_BANNED:
            x = tl.where(
                tl.load(banned_ptr + req.to(tl.int64) * stride_br + v, mask=v < vocab, other=0) != 0, float("-inf"), x
            )
        new_top = tl.maximum(top, tl.max(x, 0))
        shift = tl.where(new_top > float("-inf"), new_top, 0.0)  # no -inf - -inf while all seen are -inf
        total = total * tl.exp(top - shift) + tl.sum(tl.exp(x - shift), 0)
        top = new_top
    shift = tl.where(top > float("-inf"), top, 0.0)
    for start in range(0, vocab, BLOCK_V):
        v = start + offsets
        x = tl.load(src + v, mask=v < vocab, other=float("-inf")).to(tl.float32) / temperature
        if HAS_BANNED:
            x = tl.where(
                tl.load(banned_ptr + req.to(tl.int64) * stride_br + v, mask=v < vocab, other=0) != 0, float("-inf"), x
            )
        tl.store(dst + v, tl.exp(x - shift) / total, mask=v < vocab)
