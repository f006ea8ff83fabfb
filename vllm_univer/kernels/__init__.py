"""Tensor kernels for tree speculation inside an engine (pure PyTorch, no vLLM import):
tree attention over a paged KV cache and compaction of the accepted path's KV."""

from .kv_compaction import accepted_path_moves, move_paged_kv
from .tree_attention import (
    merge_attention_states,
    paged_context_attention,
    tree_attention,
    tree_self_attention,
)

__all__ = [
    "accepted_path_moves",
    "merge_attention_states",
    "move_paged_kv",
    "paged_context_attention",
    "tree_attention",
    "tree_self_attention",
]
