"""Does a region of code read on the host anything computed from given tensors?
Checked on any device, CPU included (where "device" tensors are host memory).

On a GPU, a host read of a device value (``.tolist()``, ``.item()``, ``bool(t)``,
``.cpu()``) waits for every kernel queued before it. The tree drafter must not
read this step's verification result (the sampled tokens) before it has launched
its forwards, or the device idles while the host prepares them.

``HostReadGuard(sources)`` follows the values of ``sources`` through the
dispatcher: the outputs of an op that read a tainted storage are tainted, and so
are the tensors it wrote in place (``copy_``, ``index_put_``, a custom op's
``out`` arguments: the schema's mutable arguments). A host read of a tainted
tensor raises ``TaintedHostRead`` while the guard is armed; ``disarm()`` ends
the region (reads after it are the allowed ones). Tainted tensors are kept alive
until the guard exits, so a freed storage's address is never mistaken for another's.
Kernels launched outside ATen (Triton) are not followed. Reads made inside a
function named in ``exempt`` are counted (``exempt_reads``), not raised: known
reads a caller has accepted, named where the guard is set up.
"""

from __future__ import annotations

import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .graph_discipline import BOOL_INDEX_OPS, _bool_index
from .op_counter import HOST_SYNC_OPS, _name


class TaintedHostRead(AssertionError):
    """The host read a value computed from the guarded tensors."""


# Host reads that dispatch no op on a CPU tensor: patched while the guard runs.
_PYTHON_READS = ("tolist", "numpy", "__array__")


class HostReadGuard(TorchDispatchMode):
    def __init__(self, sources: list[torch.Tensor], exempt: tuple[str, ...] = ()):
        super().__init__()
        self.armed = True
        self.exempt = frozenset(exempt)
        self.exempt_reads = 0
        self._tainted: dict[int, torch.Tensor] = {}  # storage address -> a tensor on it (kept alive)
        self.reads = 0  # host reads of tainted values after ``disarm``
        for tensor in sources:
            self._taint(tensor)
        self._originals = {}

    def disarm(self) -> None:
        self.armed = False

    def is_tainted(self, tensor: torch.Tensor) -> bool:
        address = _storage(tensor)
        return address != 0 and address in self._tainted

    def _taint(self, tensor: torch.Tensor) -> None:
        address = _storage(tensor)
        if address != 0:  # empty and meta tensors: no memory to follow
            self._tainted.setdefault(address, tensor)

    def _read(self, what: str, tensor: torch.Tensor) -> None:
        if not self.is_tainted(tensor):
            return
        if self.armed and self.exempt and _called_from(self.exempt):
            self.exempt_reads += 1
            return
        if self.armed:
            raise TaintedHostRead(f"the host read a tainted value ({what}) before the guard was disarmed")
        self.reads += 1

    def __enter__(self):
        for name in _PYTHON_READS:
            original = getattr(torch.Tensor, name)
            self._originals[name] = original

            def read(tensor, *args, _name=name, _original=original, **kwargs):
                self._read(_name, tensor)
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, read)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)
        self._originals.clear()
        result = super().__exit__(*exc)
        self._tainted.clear()
        return result

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        tainted = any(self.is_tainted(t) for t in inputs)
        name = _name(func)
        if tainted and (name in HOST_SYNC_OPS or _crosses_to_host(func, args, kwargs)):
            self._read(name, next(t for t in inputs if self.is_tainted(t)))
        elif name in BOOL_INDEX_OPS and _bool_index(args) and _tainted_mask(self, args):
            # The result's size is the mask's count: read on the host (a sync on CUDA).
            self._read(f"{name} by a boolean mask", next(t for t in args[1] if isinstance(t, torch.Tensor)))
        out = func(*args, **kwargs)
        if tainted:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._taint(t)
            for written in _written_arguments(func, args, kwargs):
                self._taint(written)
        return out


def _tainted_mask(guard: HostReadGuard, args) -> bool:
    return any(isinstance(t, torch.Tensor) and guard.is_tainted(t) for t in args[1] or ())


def _called_from(names: frozenset[str]) -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name in names:
            return True
        frame = frame.f_back
    return False


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _crosses_to_host(func, args, kwargs) -> bool:
    """A copy from a non-CPU device to the host (``.cpu()``, ``.to("cpu")``)."""
    if func not in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
        return False
    src = args[1] if func is torch.ops.aten.copy_.default else args[0]
    if src.device.type == "cpu":
        return False
    dst_device = args[0].device if func is torch.ops.aten.copy_.default else kwargs.get("device", src.device)
    return torch.device(dst_device).type == "cpu"


def _written_arguments(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors ``func`` writes in place (its schema's mutable arguments)."""
    written = []
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        for t in tree_flatten(value)[0]:
            if isinstance(t, torch.Tensor):
                written.append(t)
    return written
