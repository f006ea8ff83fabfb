"""Views of vLLM's paged KV cache in the layout the tree kernels read:
keys and values each ``[num_blocks, block_size, num_kv_heads, head_size]``,
strided views of the layer's one cache tensor (writes go through).

vLLM 0.32 keeps one tensor per layer, logically
``[num_blocks, num_kv_heads, block_size, 2 * head_size]``. The CUDA backends
(FlashAttention, Triton) read it as ``kv_cache.transpose(1, 2).split(head_size, -1)``
(``standard_kv_views``). The CPU attention keeps the same tensor,
``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, viewed as
``[num_blocks, num_kv_heads, 2 * block_size, head_size]`` and split into a key
half and a value half. With the ``vec`` ISA (x86 without AMX, block size a
multiple of 32; on AMX CPUs too, for tree speculation) values are stored
row-major per token, but keys are stored transposed inside each (block,
head): element (token t, dim d) sits at
``d * block_size + t``. The views below expose both as
``[num_blocks, block_size, num_kv_heads, head_size]`` without copying.
"""

from __future__ import annotations

import torch

SUPPORTED_ISAS = ("vec",)


def check_cpu_isa(isa: str | None) -> None:
    """Refuse a CPU attention ISA whose KV layout tree attention does not read (AMX
    is switched to vec for tree speculation: ``patches.patch_cpu_attention_isa``)."""
    if isa not in SUPPORTED_ISAS:
        raise NotImplementedError(
            f"tree attention on CPU reads the KV cache of the {SUPPORTED_ISAS} attention ISA; "
            f"this machine's CPU attention uses {isa!r} (vec16: head sizes not a multiple of 32; "
            "neon / vsx / vxe / rvv: non-x86 CPUs). Use a GPU."
        )


def cpu_kv_views(kv_cache: torch.Tensor, isa: str) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_cache [num_blocks, H, block_size, 2*Dh] -> (keys, values), each a strided
    view [num_blocks, block_size, H, Dh] of the same storage (writes go through)."""
    check_cpu_isa(isa)
    num_blocks, heads, block_size, two_dh = kv_cache.shape
    head_size = two_dh // 2
    if not kv_cache.is_contiguous():
        raise ValueError("expected a contiguous CPU KV cache tensor")
    s_block, s_head = kv_cache.stride(0), kv_cache.stride(1)
    # Key half of (block, head): bs * Dh elements, transposed: [Dh, bs].
    keys = kv_cache.as_strided((num_blocks, block_size, heads, head_size), (s_block, 1, s_head, block_size))
    # Value half: the next bs * Dh elements, row-major [bs, Dh].
    values = kv_cache.as_strided(
        (num_blocks, block_size, heads, head_size),
        (s_block, head_size, s_head, 1),
        storage_offset=kv_cache.storage_offset() + block_size * head_size,
    )
    return keys, values


def standard_kv_views(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The CUDA backends' split: [num_blocks, H, block_size, 2*Dh] -> (keys, values),
    each [num_blocks, block_size, H, Dh] (whatever the physical stride order)."""
    keys, values = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    return keys, values


def layer_kv_views(impl, kv_cache: torch.Tensor, isa: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) of one attention layer's cache, for the backend that owns it.
    ``isa``: the CPU backend's attention ISA (``layer.isa``), None elsewhere."""
    from .tree_attention_plan import backend_kind

    if backend_kind(impl) == "cpu":
        return cpu_kv_views(kv_cache, isa)
    return standard_kv_views(kv_cache, impl.head_size)
