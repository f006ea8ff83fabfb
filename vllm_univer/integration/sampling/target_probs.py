"""The target distribution at every tree node: exactly what vLLM would sample from.

For request b, every node row of the tree gets the request's own sampling
transforms, in vLLM's order: float32 logits -> allowed tokens, bad words and
min_tokens on the row's path (``path_masks.TreePathMasks``) -> logit_bias
(``bias_and_min_p.TreeLogitBias``) -> presence / frequency / repetition
penalties (vLLM's ``apply_penalties``, counting the tokens generated so far
plus the tokens on the path to the node) -> temperature -> min_p -> top-k /
top-p (vLLM's ``apply_top_k_top_p``) -> softmax. Temperature-0
requests are flagged greedy (the verifier then matches argmaxes). Per-request values are expanded
to rows with ``repeat_interleave``, not vLLM's CPU stand-in for its Triton
expand kernel, which returns uninitialised memory in 0.32.0.

Structured outputs arrive already applied: vLLM masks the logits with one
grammar bitmask row per tree node (``tree_grammar``) before the sampler runs.
Custom logits processors are refused at start-up (``tree_speculation``); min_p and
logit_bias, which vLLM refuses for its own speculative decoding, are accepted
for tree speculation (``patches.patch_sampling_params_validate_spec_decode``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from vllm.model_executor.layers.utils import apply_penalties
from vllm.triton_utils import HAS_TRITON
from vllm.utils.torch_utils import make_tensor_with_pad
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p, apply_top_k_top_p_pytorch

from .bias_and_min_p import apply_min_p_

SAMPLING_EPS = 1e-5  # vLLM's threshold for "temperature 0"


def tree_target_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    path_transforms: Sequence = (),
    out: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, T, V] (T tree rows per request), temperature / top_k / top_p / min_p [B],
    path_transforms: objects whose ``apply(logits)`` transforms float32 [B, T, V]
    logits in place, in order (``TreePathMasks``, ``TreeLogitBias``, ``TreePenalties``),
    out: an optional float32 [B, T, V] buffer the probabilities are computed in
    -> (probs [B, T, V] float32, greedy [B] bool)."""
    scaled, greedy = scaled_logits(logits, temperature, path_transforms, out)
    return probs_from_scaled(scaled, top_k, top_p, min_p), greedy


def scaled_logits(
    logits: torch.Tensor, temperature: torch.Tensor, path_transforms: Sequence = (), out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``tree_target_probs``' first half: (float32 [B, T, V] logits after the path
    transforms, divided by the temperature, in ``out`` when given; greedy [B] bool)."""
    batch = logits.shape[0]
    temp, greedy = split_greedy(temperature)
    temp = temp.view(batch, 1, 1)
    if path_transforms or logits.dtype != torch.float32:
        # (A float32 ``out`` of bfloat16 logits in one division takes ATen's slow
        # casting loop on CPU: 4x a copy and an in-place division.)
        scaled = processed_logits(logits, path_transforms, out).div_(temp)
    else:  # the copy and the temperature in one pass
        scaled = torch.div(logits, temp, out=out) if out is not None else logits / temp
    return scaled, greedy


def probs_from_scaled(
    scaled: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    host_reads: bool = True,
) -> torch.Tensor:
    """``tree_target_probs``' second half: scaled [B, T, V] float32 (``scaled_logits``,
    overwritten) -> probs [B, T, V] after min_p, top-k / top-p and the softmax.
    host_reads=False: nothing read back to the host (a region a graph captures)."""
    batch, rows, vocab = scaled.shape
    flat = scaled.view(batch * rows, vocab)
    if min_p is not None:
        apply_min_p_(flat, _per_row(min_p, rows))
    k = _per_row(top_k, rows) if top_k is not None else None
    p = _per_row(top_p, rows) if top_p is not None else None
    if host_reads or HAS_TRITON or (k is None and p is None):
        flat = apply_top_k_top_p(flat, k, p)
    else:
        # vLLM's top-k-only path without Triton reads the largest k back: its
        # sorting path (the same masks) reads nothing. (With Triton, as on CUDA,
        # ``apply_top_k_top_p`` runs its kernel, which reads nothing back either.)
        flat = apply_top_k_top_p_pytorch(flat, k, p, allow_cpu_sync=False)
    return softmax_(flat).view(batch, rows, vocab)


def _per_row(values: torch.Tensor, rows: int) -> torch.Tensor:
    """[B] per-request values -> [B * rows], each repeated for its request's rows
    (an expand: ``repeat_interleave`` is counted as a host read where it sees one op)."""
    return values.unsqueeze(1).expand(-1, rows).reshape(-1)


def processed_logits(
    logits: torch.Tensor, path_transforms: Sequence = (), out: torch.Tensor | None = None
) -> torch.Tensor:
    """logits [B, T, V] -> a float32 copy with the path transforms applied in order:
    what vLLM's greedy sampler takes the argmax of, and samples from after temperature.
    One [B, T, V] float32 buffer (``out`` if given), transformed in place (the
    logits may be a view of vLLM's)."""
    scaled = logits.to(torch.float32, copy=True) if out is None else out.copy_(logits)
    for transform in path_transforms:
        transform.apply(scaled)
    return scaled


def split_greedy(temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """temperature [B] -> (float32 temperature with greedy rows set to 1, greedy [B] bool),
    greedy meaning vLLM's temperature 0 (below ``SAMPLING_EPS``)."""
    greedy = temperature < SAMPLING_EPS
    return torch.where(greedy, torch.ones_like(temperature), temperature).to(torch.float32), greedy


def softmax_(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension, in place (tokens masked to -inf get 0).

    On CPU, for a contiguous x, ATen's softmax kernel writes into its own input:
    it reads each element before writing the same element, so the result is
    bit-identical to ``torch.softmax`` in a third of the passes of sub_/exp_/div_
    and with no [.., V] temporary (tested). Elsewhere, and for strided views
    (which that out= path gets wrong), the three in-place steps.
    """
    if x.device.type == "cpu" and x.is_contiguous():
        return torch.ops.aten._softmax.out(x, -1, False, out=x)
    x.sub_(x.amax(-1, keepdim=True)).exp_()
    return x.div_(x.sum(-1, keepdim=True))


class TreePenalties:
    """Presence, frequency and repetition penalties of every tree row.

    The row of node i continues the request's text with the tokens on the path
    to i, so its output-token counts are the request's generated tokens plus
    those path tokens; vLLM's own ``apply_penalties`` then does the rest.

    paths [B, T, D]: the tokens on the path to each row's node (depth 1 .. D, -1 past
    its depth or where no node is: ``token_paths`` of the step's trees),
    sampling_metadata: vLLM's.
    """

    def __init__(self, paths: torch.Tensor, sampling_metadata, batch: int):
        self.paths, self.meta, self.batch = paths, sampling_metadata, batch

    def apply(self, logits: torch.Tensor) -> None:
        """logits [B, T, V] float32, in place."""
        meta, batch = self.meta, self.batch
        _, rows, vocab = logits.shape
        device = logits.device
        generated = make_tensor_with_pad(meta.output_token_ids[:batch], pad=vocab, device="cpu", dtype=torch.int64).to(
            device
        )  # [B, Lo]
        if generated.dim() == 1:  # no request has generated anything yet
            generated = generated.view(batch, 0)
        path = self.paths[:batch].masked_fill(self.paths[:batch] < 0, vocab)  # [B, T, D]: vocab pads
        outputs = torch.cat([generated.unsqueeze(1).expand(-1, rows, -1), path], -1).flatten(0, 1)
        flat = logits.view(batch * rows, vocab)
        apply_penalties(
            flat,
            meta.prompt_token_ids[:batch].repeat_interleave(rows, 0),
            outputs,
            meta.presence_penalties[:batch].repeat_interleave(rows),
            meta.frequency_penalties[:batch].repeat_interleave(rows),
            meta.repetition_penalties[:batch].repeat_interleave(rows),
        )
