"""Would this region of code survive CUDA-graph capture and replay? Checked on
any device, CPU included, by intercepting PyTorch's dispatcher.

A captured region replays the same kernels on the same memory, with none of
the host code that built them. So, inside it:

* no host sync (``op_counter.HOST_SYNC_OPS``): capture refuses it, or bakes in
  the value read at capture;
* no factory op (``FACTORY_OPS``: ``arange``, ``full``, ``zeros``, ``empty``, a
  tensor from a Python list ...): an allocation comes from the graph's private
  pool at the captured address, and a tensor filled from host values is filled
  with the values seen at capture;
* no copy between devices (host to device or back): a pageable copy is not
  capturable, and it reads host memory the replay never refreshes;
* inputs only from persistent buffers: a tensor allocated anew each step has
  another address than the one the graph reads. ``GraphDiscipline.inputs``
  lists the storages the region read that it did not create; the same list in
  two steps with different data (trees, accepted paths) is what capture needs.

``Tensor.tolist()`` of a CPU tensor reads memory without dispatching an op: it
is not seen on CPU (on CUDA it dispatches a copy to the host, which is). Kernels
launched outside ATen (Triton) are not seen either: their arguments are
checked by the caller (``PersistentTreeAttention.launch_tensors``).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .op_counter import HOST_SYNC_OPS, _name

FACTORY_OPS = frozenset(
    {
        "aten.arange",
        "aten.empty",
        "aten.empty_like",
        "aten.empty_strided",
        "aten.full",
        "aten.full_like",
        "aten.lift_fresh",
        "aten.lift_fresh_copy",
        "aten.new_empty",
        "aten.new_empty_strided",
        "aten.new_full",
        "aten.new_ones",
        "aten.new_zeros",
        "aten.ones",
        "aten.ones_like",
        "aten.scalar_tensor",
        "aten.zeros",
        "aten.zeros_like",
    }
)


# Allocations whose contents are device ops' (or zeros): under capture they come from
# the graph's pool, at the same address every replay (a whole model's forward makes them).
ALLOCATION_OPS = frozenset(
    {
        "aten.empty",
        "aten.empty_like",
        "aten.empty_strided",
        "aten.new_empty",
        "aten.new_empty_strided",
        "aten.zeros",
        "aten.zeros_like",
        "aten.new_zeros",
    }
)


# Tensors filled with one value from the host: a graph bakes the value in, right
# where the value is a literal or fixed by what the graph is keyed on (a tree's size).
# (``arange`` too: its values follow from host scalars, the sizes a graph is keyed on.)
CONSTANT_FILL_OPS = frozenset(
    {
        "aten.arange",
        "aten.full",
        "aten.full_like",
        "aten.new_full",
        "aten.new_ones",
        "aten.ones",
        "aten.ones_like",
        "aten.scalar_tensor",
    }
)


# Tensors made from host data (``torch.tensor(...)``, a Python scalar assigned by indexing).
LIFTED_SCALAR_OPS = frozenset({"aten.lift_fresh", "aten.lift_fresh_copy"})


# Indexing by a boolean mask: the result's size is the mask's count (a sync on CUDA).
BOOL_INDEX_OPS = frozenset({"aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"})


class GraphDiscipline(TorchDispatchMode):
    """``with GraphDiscipline() as region: ...`` -> ``region.violations`` (what
    capture would break on, one line each), ``region.inputs`` (storages read and
    not created inside: (data_ptr, nbytes), sorted), ``region.ops`` (Counter of
    every ATen op). ``allow_allocations``: an allocation whose contents device ops
    write (``ALLOCATION_OPS``) is no violation (a region that runs a model's
    forward); ``constant_fills``: nor a fill with one host value
    (``CONSTANT_FILL_OPS``, or a Python scalar assigned by indexing), for a region
    whose host values are fixed per graph."""

    def __init__(self, allow_allocations: bool = False, constant_fills: bool = False):
        super().__init__()
        self.allowed = (ALLOCATION_OPS if allow_allocations else frozenset()) | (
            CONSTANT_FILL_OPS if constant_fills else frozenset()
        )
        self.ops: Counter = Counter()
        self.violations: list[str] = []
        self._created: set[int] = set()
        self._read: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func.overloadpacket) if hasattr(func, "overloadpacket") else _name(func)
        self.ops[name] += 1
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if name in HOST_SYNC_OPS or (name in BOOL_INDEX_OPS and _bool_index(args)):
            self.violations.append(f"{name}: reads a device value on the host")
        if name in LIFTED_SCALAR_OPS and "aten.scalar_tensor" in self.allowed and inputs[0].dim() == 0:
            # ``x[i] = 1.0``: PyTorch lifts the Python scalar to a 0-dim host tensor
            # and fills with it (``copy_to``): a constant fill. The lifted host tensor
            # is new every run, so it is no input either.
            inputs = []
        elif name in FACTORY_OPS and name not in self.allowed:
            self.violations.append(f"{name}: creates a tensor inside the region")
        if (
            name in ("aten._to_copy", "aten.copy_", "aten.to")
            and len({t.device for t in inputs} | _to_device(kwargs)) > 1
        ):
            self.violations.append(f"{name}: copies between devices")
        for tensor in inputs:
            ptr = tensor.untyped_storage().data_ptr()
            if ptr not in self._created:
                self._read[ptr] = tensor.untyped_storage().nbytes()
        out = func(*args, **kwargs)
        seen = {t.untyped_storage().data_ptr() for t in inputs}
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in seen:
                self._created.add(tensor.untyped_storage().data_ptr())
        return out

    @property
    def inputs(self) -> list[tuple[int, int]]:
        return sorted((ptr, n) for ptr, n in self._read.items() if ptr not in self._created)


def _bool_index(args) -> bool:
    """Whether an index op's indices (its second argument) hold a boolean mask."""
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in indices or ())


def _to_device(kwargs) -> set:
    device = kwargs.get("device")
    return {torch.device(device)} if device is not None else set()
