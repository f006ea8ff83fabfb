"""Tree attention a full CUDA graph can capture: the launch reads persistent buffers.

``cuda_tree_attention`` prepares a ``PagedTreeAttention`` per forward from that
step's ``TreeAttentionPlan``: new index tensors, masks and a key-split count
fitted to the step's longest context. A captured forward replays the launches
it saw at capture, on the addresses it saw then. So a captured batch size
(up to ``max_reqs`` tree requests of ``num_queries`` tree tokens each) owns
one ``TreePlanBuffers`` (query rows, valid rows, block-table rows, context
lengths, one int8 mask per request), and each layer layout one
``PersistentTreeAttention``: a launch prepared over those buffers with the key
splits fixed for ``max_model_len``. ``TreePlanBuffers.write`` copies a step's
plan in before the replay (outside the graph: copies only, no host sync); each
layer's call inside the graph is the kernel launch alone.

Requests past the step's own (the captured size's padding) are written as rows
that are not valid: the kernel computes nothing for them and writes no row.
"""

from __future__ import annotations

import torch

from .tree_attention_plan import TreeAttentionPlan
from .triton_paged_tree_attention import PagedTreeAttention


class TreePlanBuffers:
    """A captured batch size's plan, in buffers that stay put.

    max_reqs: R, tree requests; num_queries / num_tree_keys: Tq / Tk per request
    (the tree's positions, root included); max_blocks: the block table's width;
    max_model_len: the longest context plus tree any request may reach.
    """

    def __init__(
        self, max_reqs: int, num_queries: int, num_tree_keys: int, max_blocks: int, max_model_len: int, device
    ):
        if min(max_reqs, num_queries, num_tree_keys, max_blocks, max_model_len) < 1:
            raise ValueError("tree plan buffers: every size must be >= 1")
        self.max_reqs, self.num_queries, self.num_tree_keys = max_reqs, num_queries, num_tree_keys
        self.max_model_len = max_model_len
        self.query_rows = torch.zeros(max_reqs, num_queries, dtype=torch.int64, device=device)
        self.row_valid = torch.zeros(max_reqs, num_queries, dtype=torch.int8, device=device)
        self.block_table = torch.zeros(max_reqs, max_blocks, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(max_reqs, dtype=torch.int64, device=device)
        self.mask = torch.zeros(max_reqs, num_queries, num_tree_keys, dtype=torch.int8, device=device)

    def write(self, plan: TreeAttentionPlan, block_table: torch.Tensor) -> None:
        """Copy one step's plan in (before the replay; outside the graph).

        plan: R <= max_reqs tree requests of exactly Tq queries over Tk tree keys,
        contexts up to ``max_model_len - Tk``; block_table: the forward's
        [B, blocks] table, rows picked by ``plan.request_index``.
        """
        reqs, queries = plan.query_rows.shape
        keys = plan.mask.shape[-1]
        if reqs > self.max_reqs or queries != self.num_queries or keys != self.num_tree_keys:
            raise ValueError(
                f"a plan of {reqs} requests x {queries} queries over {keys} tree keys does not fit the captured "
                f"size ({self.max_reqs} x {self.num_queries} over {self.num_tree_keys})"
            )
        if plan.max_context_len + keys > self.max_model_len:
            raise ValueError(f"contexts up to {plan.max_context_len} exceed max_model_len {self.max_model_len}")
        width = min(block_table.shape[1], self.block_table.shape[1])
        torch.index_select(block_table[:, :width], 0, plan.request_index, out=self.block_table[:reqs, :width])
        self.query_rows[:reqs].copy_(plan.query_rows)
        self.context_lens[:reqs].copy_(plan.context_lens)
        self.mask[:reqs].copy_(plan.mask.expand(reqs, queries, keys))
        if plan.row_valid is None:
            self.row_valid[:reqs].fill_(1)
        else:
            self.row_valid[:reqs].copy_(plan.row_valid)
        self.row_valid[reqs:].fill_(0)  # the captured size's padding: no row computed, none written

    def clear(self) -> None:
        """No request (a dummy forward: warm-up or capture computes no tree row)."""
        self.row_valid.fill_(0)


class PersistentTreeAttention:
    """One layer layout's launch over ``buffers``.

    query, key_cache, value_cache, output: a layer's tensors, as in
    ``PagedTreeAttention`` (every later call's must match their shapes and
    strides); num_splits None: chosen for ``buffers.max_reqs`` requests over
    ``max_model_len`` (fixed: a graph replays the grid it captured).
    """

    def __init__(
        self,
        buffers: TreePlanBuffers,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        output: torch.Tensor,
        scale: float | None = None,
        num_splits: int | None = None,
    ):
        if buffers.block_table.shape[1] * key_cache.shape[1] < buffers.max_model_len:
            raise ValueError(
                f"{buffers.block_table.shape[1]} blocks of {key_cache.shape[1]} do not hold "
                f"max_model_len {buffers.max_model_len}"
            )
        # num_splits None: PagedTreeAttention chooses them for the buffers' R requests
        # over max_model_len, the bound it is given for every context.
        self._attention = PagedTreeAttention(
            query,
            key_cache,
            value_cache,
            buffers.block_table,
            buffers.context_lens,
            buffers.query_rows,
            buffers.mask,
            output,
            scale=scale,
            row_valid=buffers.row_valid,
            max_context_len=buffers.max_model_len,
            num_splits=num_splits,
        )
        self.num_splits = self._attention.num_splits

    def __call__(self, query, key_cache, value_cache, output) -> None:
        """One layer, as ``PagedTreeAttention.__call__``: the launch alone."""
        self._attention(query, key_cache, value_cache, output)

    def launch_tensors(self) -> list[torch.Tensor]:
        """Every tensor the launch reads besides the layer's own (what must stay put
        between capture and replay)."""
        return self._attention.launch_tensors()
