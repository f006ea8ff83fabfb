"""What a forward with tree tokens tells the attention backends, and which
backends and layer features tree attention supports.

A forward that carries tree tokens attaches a ``TreeAttentionPlan`` to its
attention metadata (``metadata.tree_plan``). The patched backends
(``cpu_tree_attention``, ``cuda_tree_attention``) let vLLM write the new
keys/values into the paged cache as usual, run vLLM's kernel for the ordinary
rows of the batch, then compute the tree rows exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class TreeAttentionPlan:
    """Which rows of a forward are tree tokens, and what each may see.

    query_rows: LongTensor [R, Tq], rows of the forward's flat token batch, per
        tree request (padding rows repeat a valid row and are not written back).
    row_valid: BoolTensor [R, Tq] or None (all valid).
    request_index: LongTensor [R], each tree request's row in the metadata's block table.
    context_lens: LongTensor [R], L: cached tokens every tree token sees in full.
    mask: BoolTensor [Tq, Tk], query j may see tree key k (ancestors and itself);
        tree key k is cached at position L + k when the layer attends. [R, Tq, Tk]:
        one mask per tree request (context-aware trees: per-request shapes).
    covers_all_rows: every row of the forward is a tree row (skip vLLM's kernel).
    max_context_len: Python int bound on context_lens (avoids a host sync).
    _derived: what every layer of the forward derives alike (``derived``).
    """

    query_rows: torch.Tensor
    row_valid: torch.Tensor | None
    request_index: torch.Tensor
    context_lens: torch.Tensor
    mask: torch.Tensor
    covers_all_rows: bool
    max_context_len: int
    _derived: dict = field(default_factory=dict, repr=False, compare=False)

    def derived(self, key, make: Callable[[], object]):
        """``make()``, computed by the first layer that asks for ``key`` and kept for
        the others (the plan lives for one forward): per-step metadata, built once."""
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]


# vLLM attention implementations whose forward is patched for tree rows.
BACKENDS = {
    "cpu": ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl"),
    "flash_attn": ("vllm.v1.attention.backends.flash_attn", "FlashAttentionImpl"),
    "triton_attn": ("vllm.v1.attention.backends.triton_attn", "TritonAttentionImpl"),
}


def backend_kind(impl) -> str | None:
    """Which supported backend ``impl`` is ("cpu", "flash_attn", "triton_attn"), else None.
    Exact class match: a subclass may change the cache layout or the forward."""
    cls = type(impl)
    for kind, (module, name) in BACKENDS.items():
        if cls.__module__ == module and cls.__name__ == name:
            return kind
    return None


def check_layer_supported(impl) -> None:
    """Refuse backends and attention features the tree kernels do not implement, at start-up."""
    if backend_kind(impl) is None:
        raise NotImplementedError(
            f"tree speculation (method 'univer') has tree attention for vLLM's CPU, FLASH_ATTN and "
            f"TRITON_ATTN backends; this layer uses {type(impl).__name__}. Pass "
            "--attention-backend FLASH_ATTN (or TRITON_ATTN)."
        )
    unsupported = []
    if getattr(impl, "sliding_window", -1) not in (-1, None, (-1, -1)):
        unsupported.append("sliding windows")
    if getattr(impl, "logits_soft_cap", 0):
        unsupported.append("logit soft-capping")
    if getattr(impl, "alibi_slopes", None) is not None:
        unsupported.append("ALiBi")
    if getattr(impl, "sinks", None) is not None:
        unsupported.append("attention sinks")
    if getattr(impl, "is_fp8_kv_cache", False) or str(getattr(impl, "kv_cache_dtype", "auto")) != "auto":
        unsupported.append("quantized (fp8) KV cache")
    if getattr(impl, "dcp_world_size", 1) > 1:
        unsupported.append("decode context parallelism")
    if getattr(impl, "kv_sharing_target_layer_name", None) is not None:
        unsupported.append("KV sharing between layers")
    if unsupported:
        raise NotImplementedError(
            f"tree speculation (method 'univer') does not support {', '.join(unsupported)} "
            f"in the {type(impl).__name__} attention backend yet"
        )
