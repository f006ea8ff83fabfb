"""Prometheus histogram of the trees drafted: draft nodes per request per step
(``vllm:univer_tree_nodes_per_request``), next to vLLM's spec-decode counters.

vLLM's scheduler already counts, per step, how many drafts had more than i
draft tokens (``SpecDecodingStats.num_draft_tokens_per_pos``); the size of every
draft follows from those counts, so the histogram needs nothing from the workers.
With ``"tree": "auto"`` it shows the cuts chosen (depth and width); a request not speculating in a
step (cut 0) drafts nothing and is not counted.
"""

from __future__ import annotations

import itertools

import prometheus_client

from ..core.tree import TreeSpec

NODES_HISTOGRAM = "vllm:univer_tree_nodes_per_request"


def cut_sizes(shapes: list[TreeSpec]) -> list[int]:
    """Draft nodes of each shape cut to depth 1, 2, ..., D (the histogram's buckets)."""
    return sorted({size for tree in shapes for size in itertools.accumulate(tree.nodes_per_depth[1:])})


def drafts_by_size(num_draft_tokens_per_pos: list[int]) -> dict[int, int]:
    """{k: drafts with exactly k nodes} from vLLM's per-position counts (entry i:
    drafts with more than i nodes)."""
    at_least = [*num_draft_tokens_per_pos, 0]
    return {k: at_least[k - 1] - at_least[k] for k in range(1, len(at_least)) if at_least[k - 1] > at_least[k]}


class TreeNodesProm:
    """The histogram, one child per engine (vLLM's label values)."""

    def __init__(self, shapes: list[TreeSpec], labelnames: list[str], per_engine_labelvalues: dict[int, list]):
        from vllm.v1.metrics.utils import create_metric_per_engine

        histogram = prometheus_client.Histogram(
            name=NODES_HISTOGRAM,
            documentation="Draft tree nodes per request per step (tree speculation; cuts of the tree with 'auto').",
            labelnames=labelnames,
            buckets=cut_sizes(shapes),
        )
        self.histograms = create_metric_per_engine(histogram, per_engine_labelvalues)

    def observe(self, num_draft_tokens_per_pos: list[int], engine_idx: int = 0) -> None:
        histogram = self.histograms[engine_idx]
        for size, drafts in drafts_by_size(num_draft_tokens_per_pos).items():
            for _ in range(drafts):
                histogram.observe(size)
