"""``verify`` in a few fused launches (Triton): univer, greedy and target_only
with one per depth level for the node rules and one for the rest of the step
(``kernels/triton_topk1_verify.py``); token and block, on chains, in one launch
for the whole step (``kernels/triton_chain_verify.py``). Same laws as the
PyTorch node rules of ``tree_pass`` (tested against them and against
``outcome_law`` in Triton's interpreter); ``verify`` takes this path on CUDA.
"""

from __future__ import annotations

import torch

from .tree import _TreeTensors
from .verifiers import TreeVerifier

CHAIN_METHODS = ("token", "block")
FUSED_METHODS = ("univer", "greedy", "target_only", *CHAIN_METHODS)


def fused_available(method: str, target_probs: torch.Tensor, draft_probs: torch.Tensor) -> bool:
    """The fused path serves ``method`` for these rows: CUDA, Triton importable,
    the vocabulary dimension contiguous."""
    if method not in FUSED_METHODS or not target_probs.is_cuda:
        return False
    if target_probs.stride(-1) != 1 or draft_probs.stride(-1) != 1:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def fused_allocate(
    verifier: TreeVerifier, tt: _TreeTensors, tokens: torch.Tensor, p: torch.Tensor, q: torch.Tensor, dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``tree_pass.allocate`` in one launch per level. tokens [B, N+1] int64; p, q
    [B, N+1, V] (any float dtype) -> weight [B, N+1] and stop [B, N+1] (``dtype``;
    the rule's h at internal nodes, all zeros for DESCENT rules) and q_bar_scale
    [B, N+1] float64 (1 / q(off T) of nodes with a sampled child, else 0) for
    ``fused_finish``."""
    from .kernels.triton_topk1_verify import topk1_level

    batch, n1, _ = p.shape
    weight = torch.zeros(batch, n1, dtype=dtype, device=p.device)
    weight[:, 0] = 1.0
    stop = torch.zeros_like(weight)
    q_bar_scale = torch.zeros(batch, n1, dtype=torch.float64, device=p.device)
    for level in tt.levels:  # a level's scales need its parents'
        topk1_level(verifier.name, p, q, tokens, level.nodes, tt.children, weight, stop, q_bar_scale)
    return weight, stop, q_bar_scale


def fused_finish(
    verifier: TreeVerifier,
    tt: _TreeTensors,
    tokens: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor,
    weight: torch.Tensor,
    stop: torch.Tensor,
    q_bar_scale: torch.Tensor,
    greedy: torch.Tensor | None,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """After ``fused_allocate``, the rest of the step in one launch: the end node,
    greedy rows' argmax matching, the next token and the output rows ->
    (output rows [B, D+1], accepted tokens [B], end node [B])."""
    from .kernels.triton_topk1_verify import finish_step

    uniforms = torch.rand(
        tokens.shape[0], tokens.shape[1] + 1, generator=generator, device=p.device, dtype=torch.float64
    )
    return finish_step(verifier.name, p, q, tokens, tt, weight, stop, q_bar_scale, uniforms, greedy)


def fused_chain_step(
    verifier: TreeVerifier,
    tokens: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor,
    greedy: torch.Tensor | None,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A chain method's whole step in one launch, greedy rows included: tokens
    [B, N+1] int64, p, q [B, N+1, V], greedy [B] bool or None -> (output rows
    [B, N+1] as ``VerifyOutput.output_token_ids``, end node [B] = accepted tokens)."""
    from .kernels.triton_chain_verify import chain_verify

    uniforms = torch.rand(
        tokens.shape[0], tokens.shape[1] + 1, generator=generator, device=p.device, dtype=torch.float64
    )
    out, end, _, _ = chain_verify(verifier.name, p, q, tokens, uniforms, greedy)
    return out, end
