"""``verify`` in a few fused launches (Triton): the tree methods with one per
depth level for the node rules (univer, greedy, target_only:
``kernels/triton_topk1_verify.py``; rrs, rrsw, traversal:
``kernels/triton_replay_verify.py``; a few per level where one program per
node would leave the GPU idle, each node's vocabulary then split across
programs) and one for the rest of the step
(``kernels/triton_finish_step.py``); univer_wor, on trees of at most four
children per node, one per level and one for the next token's draw (two where
its three-child stage may run)
(``kernels/triton_wor_verify.py``); token and block, on chains, in one launch
for the whole step (``kernels/triton_chain_verify.py``). Same laws as the
PyTorch node rules of ``tree_pass`` (tested against them and against
``outcome_law`` in Triton's interpreter); ``verify`` takes this path on CUDA.
"""

from __future__ import annotations

import torch

from .tree import TreeSpec, _TreeTensors
from .tree_batch import TreeBatch
from .tree_pass import decide_postorder, finish_stop
from .verifiers import TreeVerifier
from .verifiers.univer_wor import EXACT_RANK_VOCAB

TOPK1_METHODS = ("univer", "greedy", "target_only")
REPLAY_METHODS = ("rrs", "rrsw", "traversal")
CHAIN_METHODS = ("token", "block")
WOR_METHODS = ("univer_wor",)
FUSED_METHODS = (*TOPK1_METHODS, *REPLAY_METHODS, *CHAIN_METHODS, *WOR_METHODS)


def fused_available(
    method: str, tree: TreeSpec | TreeBatch, target_probs: torch.Tensor, draft_probs: torch.Tensor
) -> bool:
    """The fused path serves ``method`` for these rows: CUDA, Triton importable,
    the vocabulary dimension contiguous, a shape and vocabulary its kernels take."""
    return (
        method in FUSED_METHODS
        and fused_refusal(method, tree, target_probs.shape[-1]) is None
        and triton_reads(target_probs, draft_probs)
    )


def fused_refusal(method: str, tree: TreeSpec, vocab: int) -> str | None:
    """Why the fused kernels cannot verify ``method`` on this shape and vocabulary (None: they can)."""
    if method not in WOR_METHODS:
        return None
    if tree.max_children > 4:
        return f"univer_wor's kernels take trees of at most four children per node (this one has {tree.max_children})"
    if vocab <= EXACT_RANK_VOCAB:  # the PyTorch rule compares exact ratio ranks there
        return f"univer_wor's kernels take vocabularies above {EXACT_RANK_VOCAB} tokens"
    return None


def triton_reads(*rows: torch.Tensor) -> bool:
    """The Triton kernels can read these [..., V] rows: on CUDA, the vocabulary
    dimension contiguous, Triton importable."""
    if not all(r.is_cuda and r.stride(-1) == 1 for r in rows):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def fused_node_weights(
    verifier: TreeVerifier, tt: _TreeTensors | TreeBatch, tokens: torch.Tensor, p: torch.Tensor, q: torch.Tensor, dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``tree_pass.node_weights`` in one launch per level. tokens [B, N+1] int64; p, q
    [B, N+1, V] (any float dtype) -> weight [B, N+1] and stop [B, N+1] (``dtype``;
    the rule's h at internal nodes, all zeros for DESCENT rules) and the float64
    parameters of the nodes' residual rows for ``fused_finish``: univer /
    greedy / target_only [B, N+1], 1 / q(off T) of nodes with a sampled child,
    else 0; rrs / rrsw / traversal [B, N+1, 2C], each internal node's rejection
    steps a_j, then c_j (leaves' rows are never read). ``tt`` a ``TreeBatch``:
    each request's own tree (univer, greedy, target_only)."""
    from .kernels.triton_replay_verify import replay_level
    from .kernels.triton_topk1_verify import topk1_level

    batch, n1, _ = p.shape
    weight = torch.zeros(batch, n1, dtype=dtype, device=p.device)
    weight[:, 0].fill_(1.0)  # a fill: no scalar tensor copied in (capturable)
    stop = torch.zeros_like(weight)
    if verifier.name in REPLAY_METHODS:
        params = torch.empty(batch, n1, 2 * tt.children.shape[1], dtype=torch.float64, device=p.device)
        level_rule = replay_level
    else:
        params = torch.zeros(batch, n1, dtype=torch.float64, device=p.device)
        level_rule = topk1_level
    # Per-request shapes (TreeBatch): every position of each depth, the same for all requests.
    levels = tt.level_positions if isinstance(tt, TreeBatch) else [level.nodes for level in tt.levels]
    for nodes in levels:  # a level's scales need its parents'
        level_rule(verifier.name, p, q, tokens, nodes, tt.children, weight, stop, params)
    return weight, stop, params


def fused_finish(
    verifier: TreeVerifier,
    tt: _TreeTensors | TreeBatch,
    tokens: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor,
    weight: torch.Tensor,
    stop: torch.Tensor,
    params: torch.Tensor,
    greedy: torch.Tensor | None,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """After ``fused_node_weights``, the rest of the step in one launch: the end node,
    greedy rows' argmax matching, the next token and the output rows ->
    (output rows [B, D+1], accepted tokens [B], end node [B])."""
    from .kernels.triton_finish_step import finish_step

    uniforms = torch.rand(
        tokens.shape[0], tokens.shape[1] + 1, generator=generator, device=p.device, dtype=torch.float64
    )
    return finish_step(verifier.name, p, q, tokens, tt, weight, stop, params, uniforms, greedy)


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


def fused_wor_allocate(
    tt: _TreeTensors, tokens: torch.Tensor, p: torch.Tensor, q: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """univer_wor's ``tree_pass.node_weights`` in one launch per level: tokens [B, N+1] int64,
    p, q [B, N+1, V] -> entry scales [B, N+1] and stop probabilities [B, N+1] (``dtype``,
    ``finish_stop`` applied)."""
    from .kernels.triton_wor_verify import wor_level

    batch, n1, _ = p.shape
    weight = torch.zeros(batch, n1, dtype=dtype, device=p.device)
    weight[:, 0].fill_(1.0)  # a fill: no scalar tensor copied in (capturable)
    stop = torch.zeros_like(weight)
    for level in tt.levels:  # a level's scales need its parents'
        wor_level(p, q, tokens, level.nodes, tt, weight, stop)
    return weight, finish_stop(tt, tokens, weight, stop)


def fused_wor_step(
    tt: _TreeTensors,
    tokens: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor,
    dtype: torch.dtype,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """univer_wor's verification after the drafts: ``fused_wor_allocate``, the end node
    (``decide_postorder``) and the next token in one more launch -> (end node [B], next
    token [B])."""
    from .kernels.triton_wor_verify import wor_draw

    weight, stop = fused_wor_allocate(tt, tokens, p, q, dtype)
    n1 = weight.shape[1]
    uniforms = torch.rand(weight.shape[0], n1 + 1, generator=generator, device=p.device, dtype=torch.float64)
    end = decide_postorder(tt, stop, uniforms[:, :n1])
    return end, wor_draw(p, q, tokens, end, tt, weight, uniforms[:, n1].contiguous())
