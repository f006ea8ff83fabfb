"""Full CUDA graphs of the target for every tree ``tree: auto`` may verify
(``"cuda_graphs": "full"``, opt-in).

vLLM 0.32 captures FULL graphs of uniform decode batches for one query length,
1 + num_speculative_tokens: for tree speculation the whole tree. ``tree: auto``
drafts cuts of it (narrower shapes, shallower depths, no speculation at all),
whose uniform batches vLLM's dispatcher sends to the piecewise graphs: each of
their attention layers then runs from Python. ``FullGraphLengths`` adds, for
every other query length an auto step can schedule to all its requests (every
candidate shape cut to every depth, and 1: a step without speculation), FULL
graphs of uniform batches of that length at a few batch sizes, captured at
start-up with vLLM's own (``patches.patch_full_graphs_per_tree_length``) and
dispatched the way vLLM dispatches its own: the batch padded up to the next
captured batch size with empty requests.

Functions of the config, no device, no model (the patches apply them), and
``target_dummy_runs``, how the patches and ``tree: auto``'s calibration run
vLLM's dummy forwards of the target at one length.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from vllm.forward_context import BatchDescriptor

from ..core.tree import TreeSpec
from ..core.tree_batch import LevelLayout

# Batch sizes captured per extra length: powers of two, then steps of half the
# last power, so a batch is padded by at most a half (vLLM pads its own sizes
# by at most 8 tokens, over ~67 sizes per length: too many graphs for ~10 lengths).
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


def cut_query_lengths(shapes: Iterable[TreeSpec | LevelLayout]) -> set[int]:
    """Query tokens per request of every tree the shapes give when cut to any
    depth: 1 + the nodes down to that depth (depth 0: 1, no speculation)."""
    lengths = {1}
    for shape in shapes:
        per_depth = shape.nodes_per_depth
        lengths.update(sum(per_depth[: depth + 1]) for depth in range(1, len(per_depth)))
    return lengths


class FullGraphLengths:
    """The FULL graphs added beside vLLM's, per query length.

    lengths: query tokens per request of the trees to capture (``cut_query_lengths``);
    main_length: vLLM's own uniform decode length (1 + num_speculative_tokens), left
    to vLLM; max_tokens: vLLM's max_cudagraph_capture_size (no graph of more tokens,
    as for vLLM's own); max_reqs: max_num_seqs."""

    def __init__(self, lengths: Iterable[int], main_length: int, max_tokens: int, max_reqs: int):
        self.main_length = main_length
        self.batch_sizes: dict[int, list[int]] = {}
        for length in sorted(set(lengths) - {main_length}):
            most = min(max_reqs, max_tokens // length)
            sizes = sorted({b for b in BATCH_BUCKETS if b <= most} | ({most} if most >= 1 else set()))
            if sizes:
                self.batch_sizes[length] = sizes

    @property
    def lengths(self) -> list[int]:
        return list(self.batch_sizes)

    def descriptors(self) -> list[BatchDescriptor]:
        """Every graph to capture, largest first (vLLM's order: the smaller ones
        reuse the memory pool of the larger)."""
        descs = [
            BatchDescriptor(num_tokens=b * length, num_reqs=b, uniform=True)
            for length, sizes in self.batch_sizes.items()
            for b in sizes
        ]
        return sorted(descs, key=lambda d: (d.num_tokens, d.num_reqs), reverse=True)

    def descriptor(self, num_tokens: int, num_reqs: int, max_query_len: int) -> BatchDescriptor | None:
        """The graph a batch replays: ``num_reqs`` requests of ``max_query_len``
        tokens each (``num_tokens`` in all: uniform only if that is their product),
        padded to the next captured batch size; None where no graph of this
        package's holds it (vLLM's own length, a mixed batch, too many requests)."""
        sizes = self.batch_sizes.get(max_query_len)
        if sizes is None or num_tokens != max_query_len * num_reqs:
            return None
        padded = next((b for b in sizes if b >= num_reqs), None)
        if padded is None:
            return None
        return BatchDescriptor(num_tokens=padded * max_query_len, num_reqs=padded, uniform=True)


@contextmanager
def target_dummy_runs(runner, query_len: int | None = None) -> Iterator[None]:
    """vLLM's dummy runs of the target alone on ``runner`` (a ``GPUModelRunner``): its
    drafter's dummy run, which vLLM's makes too, shadowed on that instance; with
    ``query_len``, uniform dummy batches of that many tokens per request
    (``uniform_decode_query_len``). Both restored on the way out."""
    drafter = getattr(runner, "drafter", None)
    vllm_length = runner.uniform_decode_query_len
    if drafter is not None:
        drafter.dummy_run = lambda *args, **kwargs: None
    if query_len is not None:
        runner.uniform_decode_query_len = query_len
    try:
        yield
    finally:
        runner.uniform_decode_query_len = vllm_length
        if drafter is not None:
            del drafter.dummy_run
