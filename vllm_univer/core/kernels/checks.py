"""Entry checks at a kernel's Python boundary: a launch with a wrong shape, dtype or
layout would read out of bounds or garbage on the device, so it fails here, on the
host, with the argument's name. Each check reads tensor metadata only (no sync)."""

from __future__ import annotations

import torch


def expect(
    name: str,
    tensor: torch.Tensor | None,
    shape: tuple[int | None, ...],
    dtype: torch.dtype | tuple[torch.dtype, ...] | None = None,
    last_contiguous: bool = False,
    device: torch.device | None = None,
) -> None:
    """``tensor`` has ``shape`` (None: any size there), ``dtype`` (one dtype or a tuple
    of allowed ones; None: any), a contiguous last dimension where ``last_contiguous``,
    and lives on ``device``. A ``tensor`` of None passes (an optional input)."""
    if tensor is None:
        return
    if tensor.dim() != len(shape) or any(want is not None and got != want for got, want in zip(tensor.shape, shape)):
        wanted = ", ".join("*" if s is None else str(s) for s in shape)
        raise ValueError(f"{name}: expected shape [{wanted}], got {list(tensor.shape)}")
    if dtype is not None:
        allowed = dtype if isinstance(dtype, tuple) else (dtype,)
        if tensor.dtype not in allowed:
            raise ValueError(f"{name}: expected dtype {' or '.join(map(str, allowed))}, got {tensor.dtype}")
    if last_contiguous and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous (stride {tensor.stride(-1)})")
    if device is not None and tensor.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got {tensor.device}")


FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def expect_tree_rows(p: torch.Tensor, q: torch.Tensor, tokens: torch.Tensor) -> tuple[int, int, int]:
    """The rows every verify kernel reads: p, q [B, N+1, V] (any float dtype, V
    contiguous, one device) and tokens [B, N+1] int64. Returns (B, N+1, V)."""
    if p.dim() != 3:
        raise ValueError(f"p: expected shape [B, N+1, V], got {list(p.shape)}")
    batch, num_nodes, vocab = p.shape
    expect("p", p, (batch, num_nodes, vocab), FLOATS, last_contiguous=True)
    expect("q", q, (batch, num_nodes, vocab), FLOATS, last_contiguous=True, device=p.device)
    expect("tokens", tokens, (batch, num_nodes), torch.int64, device=p.device)
    return batch, num_nodes, vocab


def children_strides(children: torch.Tensor, batch: int, num_nodes: int) -> tuple[int, int]:
    """(request stride, node stride) of a children table, int64, slots contiguous:
    [N+1, C], one tree shared by the batch (request stride 0), or [B, N+1, C], each
    request's own tree (``TreeBatch``). num_nodes: N+1."""
    if children.dim() == 2:
        expect("children", children, (num_nodes, None), torch.int64, last_contiguous=True)
        return 0, children.stride(0)
    expect("children", children, (batch, num_nodes, None), torch.int64, last_contiguous=True)
    return children.stride(0), children.stride(1)
