"""Input checks for ``verify`` / ``outcome_law``: clear ValueErrors, one host sync per call."""

from __future__ import annotations

import torch

from .tree import TreeSpec
from .tree_batch import TreeBatch
from .verifiers import TreeVerifier

ROW_SUM_TOLERANCE = 1e-3


def check_inputs(
    verifier: TreeVerifier,
    tree: TreeSpec | TreeBatch,
    draft_token_ids: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    greedy: torch.Tensor | None = None,
) -> None:
    """Raise ValueError if the inputs do not describe a batch of valid trees.

    Shapes: draft_token_ids [B, N+1] (int), target_probs / draft_probs [B, N+1, V]
    (float), greedy [B] (bool). Rows of nodes that do not exist (token -1) and
    draft rows of nodes without existing children are not read and not checked.
    """
    if not isinstance(tree, (TreeSpec, TreeBatch)):
        raise ValueError(f"tree must be a TreeSpec or a TreeBatch, got {type(tree).__name__}")
    if isinstance(tree, TreeBatch) and draft_token_ids.shape[:1] != tree.parent.shape[:1]:
        raise ValueError(f"draft_token_ids has {draft_token_ids.shape[0]} rows, the tree batch {tree.batch_size}")
    if verifier.chain_only and not (isinstance(tree, TreeSpec) and tree.is_chain):
        raise ValueError(
            f"verifier {verifier.name!r} verifies a single chain; tree has up to "
            f"{tree.max_children} children per node (use e.g. '1x{tree.max_depth}')"
        )
    for name, t in (("draft_token_ids", draft_token_ids), ("target_probs", target_probs), ("draft_probs", draft_probs)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if draft_token_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"draft_token_ids must be an integer tensor, got {draft_token_ids.dtype}")
    if not target_probs.is_floating_point() or not draft_probs.is_floating_point():
        raise ValueError("target_probs and draft_probs must be floating-point tensors")
    n1 = tree.num_nodes + 1
    if draft_token_ids.dim() != 2 or draft_token_ids.shape[1] != n1:
        raise ValueError(
            f"draft_token_ids must be [B, N+1] = [B, {n1}] for this tree, got {tuple(draft_token_ids.shape)}"
        )
    batch = draft_token_ids.shape[0]
    if target_probs.dim() != 3 or target_probs.shape[:2] != (batch, n1):
        raise ValueError(f"target_probs must be [B, N+1, V] = [{batch}, {n1}, V], got {tuple(target_probs.shape)}")
    if draft_probs.shape != target_probs.shape:
        raise ValueError(
            f"draft_probs {tuple(draft_probs.shape)} and target_probs {tuple(target_probs.shape)} "
            "must have the same shape (the draft and target vocabularies must match)"
        )
    if not (draft_token_ids.device == target_probs.device == draft_probs.device):
        raise ValueError("draft_token_ids, target_probs and draft_probs must be on the same device")
    if greedy is not None:
        if not isinstance(greedy, torch.Tensor) or greedy.dtype != torch.bool or greedy.shape != (batch,):
            raise ValueError(f"greedy must be a BoolTensor of shape [{batch}] or None")
        if greedy.device != target_probs.device:
            raise ValueError("greedy must be on the same device as the probabilities")
    if batch == 0:
        return

    vocab = target_probs.shape[-1]
    tt = tree.on(draft_token_ids.device)
    tokens = draft_token_ids.long()
    exists = tokens >= 0
    exists[:, 0] = True
    parents = tt.parent.expand_as(tokens)[:, 1:]  # a TreeSpec's shared row or a TreeBatch's own
    child_count = torch.zeros_like(tokens)
    child_count.scatter_add_(1, parents.clamp(min=0), exists[:, 1:].long())
    has_child = child_count > 0

    p_sum = target_probs.sum(-1)
    q_sum = draft_probs.sum(-1)
    # One host sync for all checks; the messages are built only on failure.
    flags = torch.stack(
        [
            ((tokens[:, 1:] < -1) | (tokens[:, 1:] >= vocab)).any(),
            (exists[:, 1:] & ((parents < 0) | ~exists.gather(1, parents.clamp(min=0)))).any(),
            (exists & ~torch.isfinite(p_sum)).any() | (has_child & ~torch.isfinite(q_sum)).any(),
            (exists & (target_probs.amin(-1) < 0)).any() | (has_child & (draft_probs.amin(-1) < 0)).any(),
            (exists & ((p_sum - 1).abs() > ROW_SUM_TOLERANCE)).any()
            | (has_child & ((q_sum - 1).abs() > ROW_SUM_TOLERANCE)).any(),
        ]
    ).tolist()
    if flags[0]:
        raise ValueError(f"draft_token_ids must lie in [0, {vocab}) or be -1 for a missing node")
    if flags[1]:
        raise ValueError("malformed draft: a node has a token but its parent is missing (-1)")
    if flags[2]:
        raise ValueError("probabilities contain NaN or inf (check the logits)")
    if flags[3]:
        raise ValueError("probabilities must be non-negative")
    if flags[4]:
        raise ValueError(f"probability rows must sum to 1 (within {ROW_SUM_TOLERANCE})")
