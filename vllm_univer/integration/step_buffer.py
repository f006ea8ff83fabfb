"""A large tensor buffer kept from one engine step to the next.

The tree verifier and drafter each need a [B, N+1, V] float32 tensor per step
(300 MB for 8 requests, a 2x5 tree and a 152k vocabulary). On CPU a fresh
allocation that large is mapped anew and page-faulted in on every step, which
costs more than the arithmetic done in it (about 65 ms per 300 MB on the
2-core benchmark machine, against 15 ms to fill an existing buffer), so the
buffer is kept and grown to the largest shape seen. On CUDA, PyTorch's caching
allocator already reuses device memory; a fresh tensor per call there lets
idle memory go back to the allocator. A buffer larger than ``max_kept_bytes``
is not kept either, so one burst of large batches does not pin gigabytes of
host memory for the rest of the server's life.
"""

from __future__ import annotations

import math

import torch


class StepBuffer:
    def __init__(
        self,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        keep: bool | None = None,
        max_kept_bytes: int = 1 << 30,
    ):
        self.device = torch.device(device)
        self.dtype = dtype
        self.keep = self.device.type == "cpu" if keep is None else keep
        self.max_kept_elements = max_kept_bytes // torch.empty((), dtype=dtype).element_size()
        self._flat: torch.Tensor | None = None

    def get(self, shape: tuple[int, ...]) -> torch.Tensor:
        """An uninitialised tensor of ``shape`` (a view of the kept buffer on CPU)."""
        numel = math.prod(shape)
        if not self.keep or numel > self.max_kept_elements:
            return torch.empty(shape, dtype=self.dtype, device=self.device)
        if self._flat is None or self._flat.numel() < numel:
            self._flat = None  # free the old buffer before allocating the larger one
            self._flat = torch.empty(numel, dtype=self.dtype, device=self.device)
        return self._flat[:numel].view(shape)

    def holds(self, tensor: torch.Tensor | None) -> bool:
        """Whether ``tensor`` is a view of the kept buffer (so the next ``get`` overwrites it)."""
        return (
            tensor is not None
            and self._flat is not None
            and tensor.untyped_storage().data_ptr() == self._flat.untyped_storage().data_ptr()
        )

    def release(self) -> None:
        """Drop the kept buffer (the next ``get`` allocates a fresh one)."""
        self._flat = None


class KeptRange:
    """0 .. n-1 on ``device`` as views of one range kept across steps (grown to the
    largest n asked for): index tensors of a step's plans without a launch each."""

    def __init__(self, device: torch.device):
        self._range = torch.arange(0, device=device)

    def __call__(self, n: int) -> torch.Tensor:
        if self._range.numel() < n:
            self._range = torch.arange(max(n, 2 * self._range.numel()), device=self._range.device)
        return self._range[:n]
