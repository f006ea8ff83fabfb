"""Which code runs a ``verify`` call: chosen once per call, from the method, the
rows' device and layout, and the tree's shape; every backend samples the same law.

``FUSED_CHAIN``  token / block: the whole step in one Triton launch (CUDA).
``FUSED_WOR``    univer_wor: Triton node rules per level, the draw in one more
                 (CUDA; trees of at most four children per node, V > 64).
``FUSED_TREE``   the other tree methods: Triton node rules per level, then one
                 launch for the rest of the step (CUDA); per-request shapes
                 (``TreeBatch``: univer, greedy, target_only) too.
``COMPILED``     the PyTorch node rule under torch.compile (univer_wor; CPU,
                 opt-in: ``VLLM_UNIVER_COMPILE_RULES=1`` or ``compiled=True``).
``TORCH``        the verifier's own PyTorch node rule (everywhere else).
"""

from __future__ import annotations

import enum

import torch

from .compiled_rules import compile_by_default
from .fused_tree_pass import CHAIN_METHODS, FUSED_METHODS, WOR_METHODS, fused_available, fused_refusal
from .tree import TreeSpec
from .tree_batch import TREE_BATCH_METHODS, TreeBatch


class Backend(enum.Enum):
    FUSED_CHAIN = "fused_chain"
    FUSED_WOR = "fused_wor"
    FUSED_TREE = "fused_tree"
    COMPILED = "compiled"
    TORCH = "torch"

    @property
    def fused(self) -> bool:
        return self in (Backend.FUSED_CHAIN, Backend.FUSED_WOR, Backend.FUSED_TREE)


def choose_backend(
    method: str,
    tree: TreeSpec | TreeBatch,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    fused: bool | None = None,
    compiled: bool | None = None,
) -> Backend:
    """The backend of one ``verify`` call (``verify``'s ``fused`` / ``compiled``
    arguments: None lets the rows decide, True demands it, with a clear error
    where it cannot run; False rules it out)."""
    vocab = target_probs.shape[-1]
    if isinstance(tree, TreeBatch):  # per-request shapes: the node rules fused (CUDA) or in PyTorch
        if method not in TREE_BATCH_METHODS:
            raise ValueError(
                f"verifier {method!r} does not run on per-request tree shapes (context-aware trees); "
                f"these do: {', '.join(TREE_BATCH_METHODS)}"
            )
        if compiled:
            raise ValueError("per-request tree shapes have no compiled node rule: pass compiled=False")
        if fused is None:
            fused = fused_available(method, tree, target_probs, draft_probs)
        return Backend.FUSED_TREE if fused else Backend.TORCH
    if fused is None:
        fused = fused_available(method, tree, target_probs, draft_probs)
    elif fused and method not in FUSED_METHODS:
        raise ValueError(f"no fused kernels for {method!r}; they exist for {', '.join(FUSED_METHODS)}")
    elif fused and (refusal := fused_refusal(method, tree, vocab)):
        raise ValueError(f"fused=True: {refusal}")
    if compiled and fused:
        raise ValueError("compiled=True compiles the PyTorch node rule: pass fused=False with it")
    if fused:
        if method in CHAIN_METHODS:
            return Backend.FUSED_CHAIN
        return Backend.FUSED_WOR if method in WOR_METHODS else Backend.FUSED_TREE
    if compiled is None:
        compiled = compile_by_default(method, target_probs.device)
    return Backend.COMPILED if compiled else Backend.TORCH
