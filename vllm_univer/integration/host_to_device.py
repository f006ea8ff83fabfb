"""Host-built step inputs copied to the device without a host sync, and small
step results copied back without one (``DeviceToHost``).

``tensor.to("cuda")`` from host memory is a synchronous copy: PyTorch waits for
the stream to drain, so the host cannot build the next forward's inputs while
the GPU runs this one. ``upload`` stages the data in fresh pinned memory and
copies it ``non_blocking``, like vLLM's ``async_tensor_h2d``, but always into a
fresh staging buffer: vLLM's own pinned buffers (block tables, token tables)
change at the next step while a queued copy from them may not have run yet.
"""

from __future__ import annotations

import numpy as np
import torch
from vllm.utils.platform_utils import is_pin_memory_available


def upload(host: torch.Tensor | np.ndarray, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``host`` (a CPU tensor or numpy array) on ``device``, as ``dtype``, with no host sync.

    On a CPU device the result may share memory with ``host`` (as ``.to`` does).
    """
    if isinstance(host, np.ndarray):
        host = torch.from_numpy(host)
    dtype = dtype or host.dtype
    if torch.device(device).type == "cpu":
        return host.to(dtype)
    staged = torch.empty(host.shape, dtype=dtype, pin_memory=is_pin_memory_available()).copy_(host)
    return staged.to(device, non_blocking=True)


def upload_packed(
    parts: list[torch.Tensor | np.ndarray], device: torch.device, dtype: torch.dtype
) -> list[torch.Tensor]:
    """Several host arrays (CPU tensors or numpy) on ``device`` in one copy:
    packed as ``dtype`` by numpy (no tensor ops on the host), sent with
    ``upload``, returned as views with the parts' shapes."""
    arrays = [part.numpy() if torch.is_tensor(part) else np.asarray(part) for part in parts]
    packed = np.concatenate([a.reshape(-1).astype(_NUMPY[dtype], copy=False) for a in arrays])
    views = upload(packed, device).split([a.size for a in arrays])
    return [view.view(a.shape) for view, a in zip(views, arrays)]


class DeviceToHost:
    """A small device tensor on its way to the host: the copy is queued on the
    stream (into fresh pinned memory, ``non_blocking``) and waited for only when
    ``numpy()`` reads it, after the host has launched whatever came next.

    ``tensor.cpu()`` would drain the stream where it is called: in the middle of
    a step, the device would then idle while the host launches the rest.
    """

    def __init__(self, tensor: torch.Tensor):
        self._event = None
        if tensor.device.type != "cuda":  # the host's own memory, or a device without events here
            self._host = tensor.cpu()
            return
        self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=is_pin_memory_available())
        self._host.copy_(tensor, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def numpy(self) -> np.ndarray:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host.numpy()


_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.bool: np.bool_}
