"""A step's verification replayed from a CUDA graph (``"cuda_graphs": "full"``).

After the target forward the sampler turns the tree rows' logits into the
target's probabilities (top-k / top-p, softmax) and verifies every tree (the
fused node rules per level, then the finish: accepted path, next token, output
rows): ~30 launches on CUDA, each ~5 us of host time. Here they are one replay.

What the region reads stays put between replays:

* the scaled logits (``scaled_logits``: path transforms and temperature, written
  by the sampler into its kept probability buffer before the replay; the region
  reads them only: the warm-up run before the capture must leave its inputs as
  the replay finds them, so the probabilities go to a buffer of their own, kept
  for every graph, where ``tree: auto``'s chain estimates read them after the
  replay);
* q, the drafter's kept buffer of draft rows (read where it lies);
* the draft tokens, greedy flags and (where the batch sets them) top-k, top-p
  and min_p values, copied into the graph's own buffers before each replay (a
  few bytes per request); for per-request trees (``tree: dynamic``, a
  ``TreeBatch``) their parents too, from which the region builds the trees'
  tables (children, slots, ancestors) as the eager step does.

min_p, top-k / top-p run inside the region on a copy of the scaled logits, as
the eager sampler runs them (``probs_from_scaled``: top-k / top-p with vLLM's
own function, its Triton kernel on CUDA; without Triton its sorting path, which
needs no host sync). That kernel works in scratch
buffers vLLM keeps in module-level caches, one per vocabulary, which vLLM's
sampler replaces when a larger batch needs more rows: each graph keeps a
reference to the buffers it was captured with, so a replaced one stays alive
for the graph alone (the scratch holds nothing from one call to the next).

One graph per (tree, or the levels of per-request trees; batch size; which
options the batch sets; the three kept buffers' addresses and strides):
q lies in the drafter's buffer, or in the state's reordering buffer when the
batch's requests come in another order (``TreeState.gather``); a buffer that
grew moved. A size met at more than ``MAX_CAPTURES_PER_SIZE`` addresses is not
captured again at new ones (buffers that keep moving: it runs eagerly there);
nor is a step whose probabilities exceed what a kept buffer holds
(``StepBuffer.max_kept_bytes``), nor one whose scaled logits the sampler could
not keep (``TreeVerificationSampler._replayable``).

An all-greedy step's argmax matching (``verify_greedy``, ~27 launches) replays
a graph of its own per (tree, batch size): the argmax of the processed logits is
taken outside (vLLM's logits are a new tensor each step) and copied in with the
draft tokens.

Random draws use the device's default generator, which a CUDA graph advances at
every replay. Steps with a seeded request (its own generator) run eagerly (the
sampler decides: ``TreeVerificationSampler``). Path transforms (penalties,
masks, logit bias) are in the scaled logits already.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from vllm.triton_utils import HAS_TRITON

from .. import verify, verify_greedy
from ..core.api import VerifyOutput
from ..core.tree import TreeSpec
from ..core.tree_batch import LevelLayout, TreeBatch
from .draft_level_graphs import Capture
from .sampling.target_probs import probs_from_scaled
from .step_buffer import StepBuffer

# Graphs of one size (its buffers at other addresses) before it is left to run eagerly.
MAX_CAPTURES_PER_SIZE = 4


class _VerifyGraph:
    """One captured size: the buffers its inputs are copied into before each replay
    (per-request trees' parents among them), its replay, its output [B, D+3] (the
    output rows, the accepted count, the end node), and vLLM's top-k / top-p scratch
    buffers it was captured with (kept alive for its replays)."""

    def __init__(self, tree, inputs: dict[str, torch.Tensor | None]):
        if isinstance(tree, TreeBatch):  # the tables are built from them inside the region
            inputs = {"parent": tree.parent, **inputs}
        self.inputs = {name: None if value is None else torch.empty_like(value) for name, value in inputs.items()}
        self.replay: Callable[[], None] | None = None
        self.output: torch.Tensor | None = None
        self.scratch: list[torch.Tensor] = []

    def load(self, tree, inputs: dict[str, torch.Tensor | None]) -> None:
        """Copy this step's inputs (and per-request trees' parents) into the buffers."""
        if isinstance(tree, TreeBatch):
            self.inputs["parent"].copy_(tree.parent)
        for name, value in inputs.items():
            if value is not None:
                self.inputs[name].copy_(value)

    def tree(self, shape: TreeSpec | LevelLayout) -> TreeSpec | TreeBatch:
        """Inside the region: the step's trees, per-request ones from the parents' buffer."""
        parent = self.inputs.get("parent")
        return shape if parent is None else TreeBatch(parent, shape, shape.max_children, validate=False)

    def result(self, depth: int) -> VerifyOutput:
        output = self.output
        return VerifyOutput(output[:, : depth + 1], output[:, depth + 1], output[:, depth + 2])


def _packed(result: VerifyOutput) -> torch.Tensor:
    """A verification's result as one [B, D+3] tensor (a graph's output)."""
    counts = torch.stack([result.num_accepted, result.end_node], 1)
    return torch.cat([result.output_token_ids, counts], 1)


def _layout(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


class VerifyGraphs:
    """Verification steps replayed from graphs. method: the verifier; capture:
    how a graph is made (``draft_level_graphs.cuda_graph_capture()`` on CUDA);
    fused: ``verify``'s (None: the Triton kernels on CUDA; tests force them on CPU)."""

    def __init__(self, method: str, capture: Capture, fused: bool | None = None):
        self.method = method
        self.fused = fused
        self.capture = capture
        # Where the replays write the target's probabilities (one buffer for every graph).
        self.probs: StepBuffer | None = None
        self.graphs: dict[tuple, _VerifyGraph] = {}
        self.captures: dict[tuple, int] = {}
        self.replays = 0

    def verify(
        self,
        tree: TreeSpec | TreeBatch,
        tokens: torch.Tensor,
        scaled: torch.Tensor,
        q: torch.Tensor,
        greedy: torch.Tensor,
        top_k: torch.Tensor | None = None,
        top_p: torch.Tensor | None = None,
        min_p: torch.Tensor | None = None,
    ) -> tuple[VerifyOutput, torch.Tensor] | None:
        """(``verify(method, tree, tokens, p, q, greedy)``, p) with p [B, N+1, V] the
        target's probabilities from ``scaled`` (left as it is): min_p, top-k / top-p,
        the softmax (``probs_from_scaled``), in a buffer kept for the replays (valid
        until the next call); None where this size runs eagerly (the caller verifies).

        tree: one shape for the batch, or per-request trees (``TreeBatch``: a graph per
        layout, the parents copied in);
        tokens [B, N+1] int64; scaled [B, N+1, V] float32; q [B, N+1, V]; greedy [B] bool;
        top_k [B] int, top_p [B] float32, min_p [B] float32: the requests' values, or
        None where no request of the batch sets them."""
        options = {"top_k": top_k, "top_p": top_p, "min_p": min_p}
        shape = tree.layout if isinstance(tree, TreeBatch) else tree
        size = (shape, tokens.shape[0], *(value is not None for value in options.values()))
        if self.probs is None:
            self.probs = StepBuffer(scaled.device, keep=True)
        probs = self.probs.get(tuple(scaled.shape))
        if not self.probs.holds(probs):  # past what a buffer keeps: a new one each step, eager
            return None
        key = (*size, _layout(scaled), _layout(q), _layout(probs))
        graph = self.graphs.get(key)
        inputs = {"tokens": tokens, "greedy": greedy, **options}
        if graph is None:
            captured = self.captures.get(size, 0)
            if captured >= MAX_CAPTURES_PER_SIZE:  # buffers that keep moving: eager
                return None
            self.captures[size] = captured + 1
            graph = self.graphs[key] = _VerifyGraph(tree, inputs)
        graph.load(tree, inputs)
        if graph.replay is None:
            graph.replay, graph.output = self.capture(lambda: self._region(graph, shape, scaled, q, probs))
            graph.scratch = _top_k_top_p_scratch() if top_k is not None or top_p is not None else []
        graph.replay()
        self.replays += 1
        return graph.result(tree.max_depth), probs

    def verify_greedy(self, tree: TreeSpec | TreeBatch, tokens: torch.Tensor, argmax: torch.Tensor) -> VerifyOutput:
        """``verify_greedy(tree, tokens, argmax)`` (an all-greedy step's argmax
        matching) replayed: tokens, argmax [B, N+1] int64, copied in (the argmax is
        taken outside, from logits that are vLLM's own tensor each step)."""
        shape = tree.layout if isinstance(tree, TreeBatch) else tree
        key = ("greedy", shape, tokens.shape[0])
        inputs = {"tokens": tokens, "argmax": argmax}
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = _VerifyGraph(tree, inputs)
        graph.load(tree, inputs)
        if graph.replay is None:
            buffers = graph.inputs
            graph.replay, graph.output = self.capture(
                lambda: _packed(verify_greedy(graph.tree(shape), buffers["tokens"], buffers["argmax"]))
            )
        graph.replay()
        self.replays += 1
        return graph.result(tree.max_depth)

    def _region(
        self, graph: _VerifyGraph, shape: TreeSpec | LevelLayout, scaled: torch.Tensor, q: torch.Tensor, p: torch.Tensor
    ) -> torch.Tensor:
        """The captured region: per-request trees' tables from their parents, the
        probabilities into p (not in place: ``scaled`` is an input of every replay),
        then the verification."""
        buffers = graph.inputs
        options = {name: buffers[name] for name in ("top_k", "top_p", "min_p")}
        if any(value is not None for value in options.values()):
            probs_from_scaled(p.copy_(scaled), **options, host_reads=False)  # in place in p
        else:
            torch.ops.aten._softmax.out(scaled, -1, False, out=p)
        tree, tokens, greedy = graph.tree(shape), buffers["tokens"], buffers["greedy"]
        return _packed(verify(self.method, tree, tokens, p, q, greedy=greedy, validate=False, fused=self.fused))


def _top_k_top_p_scratch() -> list[torch.Tensor]:
    """The scratch buffers and tables vLLM's Triton top-k / top-p kernel keeps in
    module-level caches (vLLM 0.32: ``topk_topp_triton``), as a graph captured
    now reads them; empty without Triton."""
    if not HAS_TRITON:
        return []
    from vllm.v1.sample.ops import topk_topp_triton as caches

    tensors = list(caches._TRITON_BUFFER_CACHE.values())
    for tables in caches._TRITON_TABLE_CACHE.values():
        tensors.extend(tables)
    for workspace in caches._TRITON_SPLIT_CACHE.values():
        tensors.extend(workspace.values())
    return tensors
