"""The draft model's level forwards under full CUDA graphs (``"cuda_graphs": "full"``).

vLLM captures the draft model PIECEWISE only: attention, and with it our tree
plan, runs eagerly from Python between the graph pieces. A level forward of a
small draft at small batch is then bound by host time: every layer pays a
graph piece's replay and a Python attention call (~12 us a layer on the host,
``benchmarks/results/attention_host_overhead.md``), where the GPU needs a few
microseconds. Here a level forward whose requests all run the same number of
query tokens (level 0 after a verified tree: its last two tokens; every deeper
level of a tree: its level's nodes) replays one graph of the whole model:

* one graph per (query tokens per request W, tree keys K, padded request count
  R): the requests padded to a power of two (``padded_requests``), their
  tokens to R * W;
* its inputs stay put: token ids, positions and cache slots in the proposer's
  buffers (padding slots -1: the padding writes no key or value), the
  attention plan in a ``GraphTreePlan`` (``TreePlanBuffers``: query rows,
  valid rows, block-table rows, context lengths, ancestor masks; level 0 and a
  chain's levels as causal plans), written by copies before each replay;
* every layer's attention is the tree kernel's launch over those buffers
  (``PersistentTreeAttention``, its key splits fixed for ``max_model_len``);
  vLLM's own kernel does not run (every row of such a batch is planned).

A graph is captured the first time its size is met (a warm-up forward, eager
and real, then the capture, then the replay). Batches that are not uniform
(prompts catching up at level 0), requests past the largest bucket, and
multimodal or M-RoPE drafts keep the piecewise path.

``capture`` makes a graph of a function: on CUDA ``cuda_graph_capture``; the
CPU tests pass ``rerun_capture``, whose replay runs the function again on the
same buffers, which is what a graph replays when the region reads nothing but
those buffers and syncs nothing (``tools/graph_discipline.py`` checks both in
the engine test).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch
from vllm.config import CUDAGraphMode

from .attention.persistent_tree_attention import TreePlanBuffers
from .attention.tree_attention_plan import TreeAttentionPlan
from .attention.tree_graph_plans import GraphTreePlan
from .draft_forward import DraftModelInputs, run_draft_model
from .draft_inputs import LevelInputs
from .step_buffer import KeptRange

# A captured function's replay, and the output tensor the replay writes.
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]


def cuda_graph_capture(pool=None) -> Capture:
    """Capture on CUDA: a warm-up run on a side stream (Triton compiles, launches are
    prepared, caches filled: nothing of that may happen under capture), then the
    capture into ``pool`` (shared by the drafter's graphs, which replay one at a time)."""
    pool = torch.cuda.graph_pool_handle() if pool is None else pool

    def capture(fn):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            output = fn()
        return graph.replay, output

    return capture


def rerun_capture(fn):
    """A graph's stand-in where none can be captured (CPU tests): a warm-up run and
    the "captured" run, as ``cuda_graph_capture`` makes them; the replay runs ``fn``
    again and writes its result into the captured run's output tensor."""
    fn()
    output = fn()

    def replay() -> None:
        output.copy_(fn())

    return replay, output


def padded_requests(reqs: int) -> int:
    """The request count a level's graph is captured for: the next power of two."""
    return 1 << max(0, reqs - 1).bit_length()


class _LevelGraph:
    """One captured size: its plan buffers, the layers' metadata over them, its
    replay and the hidden states it writes, [R * W, H]."""

    def __init__(self, plan: GraphTreePlan, metadata: dict):
        self.plan = plan
        self.metadata = metadata
        self.replay: Callable[[], None] | None = None
        self.output: torch.Tensor | None = None


class DraftLevelGraphs:
    """Full graphs of the draft model's level forwards.

    proposer: vLLM's draft proposer (the model, its persistent ``input_ids``,
    ``positions`` and slot-mapping buffers, its draft layer names);
    max_model_len: the engine's; max_reqs: the most requests of one step;
    capture: how a graph is made (``cuda_graph_capture()`` on CUDA).
    """

    def __init__(self, proposer, max_model_len: int, max_reqs: int, capture: Capture):
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.max_reqs = max_reqs
        self.capture = capture
        self.graphs: dict[tuple[int, int, int], _LevelGraph] = {}
        self.replays = 0
        self._causal: dict[int, torch.Tensor] = {}
        self._range = KeptRange(proposer.input_ids.device)
        # Graphs captured on token ids and 1-D positions only.
        self.enabled = not (proposer.uses_mrope or proposer.supports_mm_inputs)

    def forward(
        self, token_ids: torch.Tensor, level: LevelInputs, block_table: torch.Tensor, plan: TreeAttentionPlan | None
    ) -> torch.Tensor | None:
        """The draft model's hidden states [T, H] over a level's T = R * W query
        tokens, replayed from the graph of its size; None where no graph runs it
        (not every request runs W tokens, too many requests): the caller runs it
        piecewise.

        token_ids [T], level: the forward's positions, slots and query layout;
        block_table [R, blocks] (int32); plan: the level's tree rows (every token of
        every request, ``covers_all_rows``), or None for causal rows (level 0, a chain).
        """
        reqs = len(level.seq_lens_cpu)
        width = level.max_query_len
        num_tokens = len(token_ids)
        padded = padded_requests(reqs)
        if not self.enabled or num_tokens != reqs * width or padded > self.max_reqs:
            return None
        if padded * width > self.proposer.input_ids.shape[0]:
            return None
        if plan is None:
            plan = self._causal_plan(level, reqs, width)
        key = (width, plan.mask.shape[-1], padded)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = self._new_graph(key, block_table)
        proposer = self.proposer
        proposer.input_ids[:num_tokens].copy_(token_ids)
        proposer.positions[:num_tokens].copy_(level.positions)
        proposer._get_slot_mapping(padded * width, level.slot_mapping)  # the padding's slots -1
        graph.plan.write(plan, block_table)
        if graph.replay is None:
            graph.replay, graph.output = self.capture(lambda: self._run(graph, padded * width))
        graph.replay()
        self.replays += 1
        return graph.output[:num_tokens]

    def _new_graph(self, key: tuple[int, int, int], block_table: torch.Tensor) -> _LevelGraph:
        width, keys, padded = key
        buffers = TreePlanBuffers(padded, width, keys, block_table.shape[1], self.max_model_len, block_table.device)
        plan = GraphTreePlan(buffers)
        # The layers read nothing of their metadata but the plan (it covers every row).
        metadata = SimpleNamespace(tree_plan=plan)
        return _LevelGraph(plan, {name: metadata for name in self.proposer._draft_attn_layer_names})

    def _run(self, graph: _LevelGraph, total: int) -> torch.Tensor:
        """The captured region: the draft model over the buffers' first ``total`` tokens,
        eagerly inside the capture (``CUDAGraphMode.NONE``: vLLM's pieces run as they are)."""
        proposer = self.proposer
        slots = proposer._get_slot_mapping(total)  # views of the slot buffer, as written
        inputs = DraftModelInputs(
            CUDAGraphMode.NONE, total, total, proposer.input_ids[:total], proposer.positions[:total], slots
        )
        return run_draft_model(proposer, inputs, graph.metadata)

    def _causal_plan(self, level: LevelInputs, reqs: int, width: int) -> TreeAttentionPlan:
        """Causal rows as a plan: each request's W tokens are its last, token t sees
        the context (``seq_lens`` - W keys) and the request's tokens up to t."""
        if width not in self._causal:
            device = level.positions.device
            self._causal[width] = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        return TreeAttentionPlan(
            query_rows=self._range(reqs * width).view(reqs, width),
            row_valid=None,
            request_index=self._range(reqs),
            context_lens=level.seq_lens.to(torch.int64) - width,
            mask=self._causal[width],
            covers_all_rows=True,
            max_context_len=level.max_seq_len - width,
        )
