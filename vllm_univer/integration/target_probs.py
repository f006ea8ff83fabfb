"""The target distribution at every tree node: exactly what vLLM would sample from.

For request b, every node row of the tree gets the request's own sampling
transforms, in vLLM's order: float32 logits -> temperature -> top-k / top-p
(vLLM's ``apply_top_k_top_p``) -> softmax. Temperature-0 requests are flagged
greedy (the verifier then matches argmaxes). Per-request values are expanded
to rows with ``repeat_interleave``, not vLLM's CPU stand-in for its Triton
expand kernel, which returns uninitialised memory in 0.32.0.

Transforms that depend on the tokens generated so far (penalties, bad words,
min-tokens) differ between tree paths; they are refused by
``check_supported`` until they are applied per path.
"""

from __future__ import annotations

import torch
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

SAMPLING_EPS = 1e-5  # vLLM's threshold for "temperature 0"


def tree_target_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, T, V] (T tree rows per request), temperature / top_k / top_p [B]
    -> (probs [B, T, V] float32, greedy [B] bool)."""
    batch, rows, vocab = logits.shape
    greedy = temperature < SAMPLING_EPS
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).to(torch.float32)
    # One [B, T, V] float32 buffer, transformed in place (the logits may be a view of vLLM's).
    scaled = logits.to(torch.float32, copy=True).div_(temp.view(batch, 1, 1)).view(batch * rows, vocab)
    k = top_k.repeat_interleave(rows) if top_k is not None else None
    p = top_p.repeat_interleave(rows) if top_p is not None else None
    scaled = apply_top_k_top_p(scaled, k, p)
    return softmax_(scaled).view(batch, rows, vocab), greedy


def softmax_(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension, in place (rows of -inf-masked logits stay 0)."""
    x.sub_(x.amax(-1, keepdim=True)).exp_()
    return x.div_(x.sum(-1, keepdim=True))


def check_supported(sampling_metadata) -> None:
    """Raise ValueError naming the first sampling option tree verification cannot honour yet."""
    if not sampling_metadata.no_penalties:
        raise ValueError("tree speculation does not support presence/frequency/repetition penalties yet")
    if sampling_metadata.bad_words_token_ids:
        raise ValueError("tree speculation does not support bad_words yet")
    if sampling_metadata.allowed_token_ids_mask is not None:
        raise ValueError("tree speculation does not support allowed_token_ids yet")
