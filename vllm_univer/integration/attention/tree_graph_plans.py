"""Tree rows inside vLLM's full CUDA graphs (``"cuda_graphs": "full"``, opt-in).

Under ``FULL_AND_PIECEWISE`` vLLM captures, per padded token count, one graph
of the whole target forward for uniform decode batches: every request with
1 + num_speculative_tokens query tokens, which for tree speculation is a batch
of whole trees (N + 1 positions each); with ``tree: auto``, this package adds
graphs of uniform batches of each cut's length (``full_graph_lengths``). Mixed
batches (prompts, trees cut short by the scheduler, requests cut to different
depths) keep the piecewise graphs and the per-step ``TreeAttentionPlan``.

A graph replays the launches of its capture, so such a forward's attention
layers get a ``GraphTreePlan`` instead: the captured size's ``TreePlanBuffers``
(the step's plan copied in before the replay, every request of the batch a
row: ``uniform_batch_plan``; cleared for vLLM's dummy forwards, warm-up and
capture) and the layer launches prepared over them,
which live as long as the graph. The layers skip vLLM's causal kernel
(``covers_all_rows``): every row of a uniform tree batch is a tree row, and a
padding row's output is never read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from .persistent_tree_attention import TreePlanBuffers
from .tree_attention_plan import TreeAttentionPlan


@dataclass(eq=False)
class GraphTreePlan:
    """What the attention layers of a full-graph forward read: ``buffers`` and, per
    layer layout, the launch over them (``derived``, kept across steps)."""

    buffers: TreePlanBuffers
    launches: dict = field(default_factory=dict)
    covers_all_rows: bool = True
    _view: TreeAttentionPlan | None = field(default=None, repr=False)

    def derived(self, key, make: Callable[[], object]):
        if key not in self.launches:
            self.launches[key] = make()
        return self.launches[key]

    def write(self, plan: TreeAttentionPlan, block_table: torch.Tensor) -> None:
        """This forward's plan into the buffers (``TreePlanBuffers.write``)."""
        self.buffers.write(plan, block_table)
        self._view = None

    def clear(self) -> None:
        """No request (a dummy forward)."""
        self.buffers.clear()
        self._view = None

    def written_plan(self) -> tuple[TreeAttentionPlan, torch.Tensor]:
        """(the buffers as a ``TreeAttentionPlan``, its block-table rows [R, blocks]),
        for a backend that computes the rows with ATen ops (vLLM's CPU backend, where
        nothing is captured): one plan per write, so what its layers derive from it
        (key masks, workspaces) is shared by one forward's layers and no longer."""
        if self._view is None:
            b = self.buffers
            self._view = TreeAttentionPlan(
                query_rows=b.query_rows,
                row_valid=b.row_valid.bool(),
                request_index=torch.arange(b.max_reqs, device=b.query_rows.device),
                context_lens=b.context_lens,
                mask=b.mask.bool(),
                covers_all_rows=True,
                max_context_len=b.max_model_len - b.num_tree_keys,
            )
        return self._view, self.buffers.block_table


class TreeGraphPlans:
    """One ``GraphTreePlan`` per graph vLLM captures of uniform batches of trees:
    per (padded token count, query tokens per request).

    query_lens: the query tokens of each request in a uniform batch a full graph
    may run: N + 1 (the whole tree), and with ``tree: auto`` the lengths of its
    cuts (``full_graph_lengths``); max_model_len: the engine's (fixes every
    launch's key splits)."""

    def __init__(self, query_lens: Iterable[int], max_model_len: int):
        self.query_lens = frozenset(query_lens)
        self.max_model_len = max_model_len
        self.plans: dict[tuple[int, int], GraphTreePlan] = {}

    def for_forward(
        self, num_tokens_padded: int, query_len: int, plan: TreeAttentionPlan | None, block_table: torch.Tensor
    ) -> GraphTreePlan:
        """The plan of a forward of uniform batch vLLM runs under a full graph,
        ``query_len`` tokens per request, padded to ``num_tokens_padded`` tokens:
        that graph's buffers with ``plan`` written in (every request of the batch,
        ``uniform_batch_plan``), or cleared (None: a dummy forward).
        block_table: the forward's [B, blocks] table."""
        if query_len not in self.query_lens:
            raise ValueError(
                f"no full-graph tree plan for {query_len} tokens per request (have {sorted(self.query_lens)})"
            )
        graph_plan = self.plans.get((num_tokens_padded, query_len))
        if graph_plan is None:
            max_reqs = -(-num_tokens_padded // query_len)
            buffers = TreePlanBuffers(
                max_reqs, query_len, query_len, block_table.shape[1], self.max_model_len, block_table.device
            )
            graph_plan = self.plans[num_tokens_padded, query_len] = GraphTreePlan(buffers)
        if plan is None:
            graph_plan.clear()
        else:
            graph_plan.write(plan, block_table)
        return graph_plan


def uniform_batch_plan(
    tree_plan: TreeAttentionPlan | None, context_lens: torch.Tensor, max_context_len: int, num_tree_tokens: int
) -> TreeAttentionPlan:
    """Every request of a uniform batch (each with T query tokens, in batch order)
    as a plan row: the trees' rows from ``tree_plan`` (their ancestor masks),
    every other request (a prompt chunk of exactly T tokens, which vLLM's
    dispatcher counts as uniform too) causal: token t sees the chunk's tokens up to t.

    context_lens: [B] cached tokens of every request, on the device; max_context_len:
    their largest (a Python int)."""
    batch, t = context_lens.shape[0], num_tree_tokens
    device = context_lens.device
    mask = torch.ones(t, t, dtype=torch.bool, device=device).tril().expand(batch, t, t).clone()
    if tree_plan is not None:
        # A tree of fewer positions than T (a request drafted for a larger shape than
        # this step's, whose tree is not verified): its rows past the tree stay causal,
        # as vLLM's own kernel computes them outside full graphs.
        m = tree_plan.mask.shape[-1]
        reqs = tree_plan.request_index
        mask[reqs, :m, :m] = tree_plan.mask.to(torch.bool).expand(len(reqs), m, m)
    return TreeAttentionPlan(
        query_rows=torch.arange(batch * t, device=device).view(batch, t),
        row_valid=None,
        request_index=torch.arange(batch, device=device),
        context_lens=context_lens,
        mask=mask,
        covers_all_rows=True,
        max_context_len=max_context_len,
    )
