"""A step's verification replayed from a CUDA graph (``"cuda_graphs": "full"``).

After the target forward the sampler turns the tree rows' logits into the
target's probabilities (top-k / top-p, softmax) and verifies every tree (the
fused node rules per level, then the finish: accepted path, next token, output
rows): ~30 launches on CUDA, each ~5 us of host time. Here they are one replay.

What the region reads stays put between replays:

* the scaled logits (``scaled_logits``: path transforms and temperature, written
  by the sampler into its kept probability buffer before the replay; the region
  reads them only: the warm-up run before the capture must leave its inputs as
  the replay finds them, so the softmax writes the graph's own memory);
* q, the drafter's kept buffer of draft rows (read where it lies);
* the draft tokens and greedy flags, copied into the graph's own buffers before
  each replay (a few bytes per request).

One graph per (tree, batch size, the two kept buffers' addresses and strides):
q lies in the drafter's buffer, or in the state's reordering buffer when the
batch's requests come in another order (``TreeState.gather``); a buffer that
grew moved. A size met at more than ``MAX_CAPTURES_PER_SIZE`` addresses is not
captured again at new ones (buffers that keep moving: it runs eagerly there).

Random draws use the device's default generator, which a CUDA graph advances at
every replay. Steps with what the region cannot replay run eagerly (the sampler
decides: ``TreeVerificationSampler``):
seeded requests (their own generators), min_p, path transforms (penalties,
masks, logit bias), per-request trees, ``tree: auto`` (its chain estimates read p),
and top-k / top-p: vLLM's Triton top-k / top-p kernel keeps a scratch buffer per
vocabulary that its own sampler replaces when a larger batch needs more rows, and
a graph would go on writing the freed one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import verify
from ..core.api import VerifyOutput
from ..core.tree import TreeSpec
from .draft_level_graphs import Capture

# Graphs of one size (its buffers at other addresses) before it is left to run eagerly.
MAX_CAPTURES_PER_SIZE = 4


class _VerifyGraph:
    """One captured size: the buffers it reads, its replay, its output [B, D+3]
    (the output rows, the accepted count, the end node)."""

    def __init__(self, tokens: torch.Tensor, greedy: torch.Tensor):
        self.tokens = torch.empty_like(tokens)
        self.greedy = torch.empty_like(greedy)
        self.replay: Callable[[], None] | None = None
        self.output: torch.Tensor | None = None


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
        self.graphs: dict[tuple, _VerifyGraph] = {}
        self.captures: dict[tuple, int] = {}
        self.replays = 0

    def verify(
        self,
        tree: TreeSpec,
        tokens: torch.Tensor,
        scaled: torch.Tensor,
        q: torch.Tensor,
        greedy: torch.Tensor,
    ) -> VerifyOutput | None:
        """``verify(method, tree, tokens, p, q, greedy)`` with p the softmax of
        ``scaled`` (left as it is); None where this size runs eagerly (the caller verifies).

        tokens [B, N+1] int64; scaled [B, N+1, V] float32; q [B, N+1, V]; greedy [B] bool."""
        size = (tree, tokens.shape[0])
        key = (*size, _layout(scaled), _layout(q))
        graph = self.graphs.get(key)
        if graph is None:
            captured = self.captures.get(size, 0)
            if captured >= MAX_CAPTURES_PER_SIZE:  # buffers that keep moving: eager
                return None
            self.captures[size] = captured + 1
            graph = self.graphs[key] = _VerifyGraph(tokens, greedy)
        graph.tokens.copy_(tokens)
        graph.greedy.copy_(greedy)
        if graph.replay is None:
            graph.replay, graph.output = self.capture(lambda: self._region(graph, tree, scaled, q))
        graph.replay()
        self.replays += 1
        depth = tree.max_depth
        return VerifyOutput(graph.output[:, : depth + 1], graph.output[:, depth + 1], graph.output[:, depth + 2])

    def _region(self, graph: _VerifyGraph, tree: TreeSpec, scaled: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """The captured region: the probabilities (out of place: ``scaled`` is an
        input of every replay), then the verification."""
        p = torch.softmax(scaled, dim=-1)
        result = verify(self.method, tree, graph.tokens, p, q, greedy=graph.greedy, validate=False, fused=self.fused)
        counts = torch.stack([result.num_accepted, result.end_node], 1)
        return torch.cat([result.output_token_ids, counts], 1)
