"""Count the ATen operations (on CUDA: kernel launches, roughly) and the host
syncs a piece of code issues, by intercepting PyTorch's dispatcher
(``TorchDispatchMode``). Runs on any device, CPU included, so launch-count
budgets can be tested on machines without a GPU.
"""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

# Ops whose result the host must wait for on CUDA: a scalar read, or an output
# whose size depends on the data.
HOST_SYNC_OPS = frozenset(
    {
        "aten._local_scalar_dense",
        "aten.item",
        "aten.is_nonzero",
        "aten.equal",
        "aten.nonzero",
        "aten.masked_select",
        "aten.unique",
        "aten._unique",
        "aten._unique2",
        "aten.unique_consecutive",
        "aten.unique_dim",
        "aten.bincount",
        "aten.repeat_interleave",
        "aten.allclose",
    }
)
# Ops that only describe existing memory: no kernel on any device.
VIEW_OPS = frozenset(
    {
        "aten.view",
        "aten._unsafe_view",
        "aten.reshape",
        "aten.expand",
        "aten.as_strided",
        "aten.slice",
        "aten.select",
        "aten.unsqueeze",
        "aten.squeeze",
        "aten.permute",
        "aten.transpose",
        "aten.t",
        "aten.alias",
        "aten.detach",
        "aten.unbind",
        "aten.split",
        "aten.split_with_sizes",
        "aten.chunk",
        "aten.narrow",
        "aten.diagonal",
        "aten.view_as",
        "aten.expand_as",
        "aten.lift_fresh",
        "aten.empty",
        "aten.empty_like",
        "aten.empty_strided",
        "aten.new_empty",
        "aten.new_empty_strided",
    }
)


def _name(func) -> str:
    return f"aten.{func.__name__.split('.')[0]}" if hasattr(func, "__name__") else str(func)


class OpCounter(TorchDispatchMode):
    """``with OpCounter() as ops: ...`` -> ``ops.kernels`` (ATen ops that launch
    work: every op but views and uninitialised allocations), ``ops.syncs``
    (ops that make the host wait on CUDA), ``ops.by_name`` (Counter of all ops).

    ``section(name)`` attributes the ops issued inside it to ``name`` (the
    innermost open section wins), in ``ops.sections``."""

    def __init__(self):
        super().__init__()
        self.by_name: Counter = Counter()
        self.sections: dict[str, Counter] = {}
        self._open: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = _name(func.overloadpacket) if hasattr(func, "overloadpacket") else _name(func)
        self.by_name[name] += 1
        if self._open:
            self.sections.setdefault(self._open[-1], Counter())[name] += 1
        return func(*args, **(kwargs or {}))

    def push(self, section: str) -> None:
        self._open.append(section)

    def pop(self) -> None:
        self._open.pop()

    @staticmethod
    def summary(by_name: Counter) -> dict[str, int]:
        """{"kernels": ..., "syncs": ...} of a Counter of op names."""
        return {
            "kernels": sum(n for op, n in by_name.items() if op not in VIEW_OPS),
            "syncs": sum(n for op, n in by_name.items() if op in HOST_SYNC_OPS),
        }

    @property
    def kernels(self) -> int:
        return self.summary(self.by_name)["kernels"]

    @property
    def syncs(self) -> int:
        return self.summary(self.by_name)["syncs"]
