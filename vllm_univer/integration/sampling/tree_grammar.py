"""Structured outputs on a token tree: one grammar bitmask row per tree node.

vLLM's ``StructuredOutputManager`` fills, for a chain of draft tokens, the
bitmask of each position by advancing the request's grammar along the chain.
A tree holds one text per path, so the row of node v needs the grammar state
after the tokens on the path root -> v: a depth-first walk accepts a node's
token on the way down and rolls it back on the way up, leaving the grammar as
it found it. Rows come out in vLLM's speculative layout (the root's row, then
the row of node i for each scheduled node i), which vLLM's
``apply_grammar_bitmask`` maps onto exactly the logits rows the tree verifier
reads, so the target law of every node is the grammar-masked one.

A node whose token the grammar refuses has target probability 0 at its parent,
so no verifier accepts it or anything below it; its subtree's rows repeat the
parent's row only so that every row stays a valid (non-empty) law.
"""

from __future__ import annotations

import torch

from ...core.tree import TreeSpec


class TreeGrammarBitmask:
    """Grammar bitmask rows for the nodes of one tree shape."""

    def __init__(self, tree: TreeSpec):
        parent = tree.parent.tolist()
        self.num_nodes = tree.num_nodes
        self.children: list[list[int]] = [[] for _ in parent]
        for node in range(1, len(parent)):
            self.children[parent[node]].append(node)
        # Breadth-first numbering: a node's descendants all come after it.
        self.subtree: list[list[int]] = [[v] for v in range(len(parent))]
        for node in range(len(parent) - 1, 0, -1):
            self.subtree[parent[node]].extend(self.subtree[node])

    def fill(
        self, grammar, request_id: str, node_tokens: list[int], bitmask: torch.Tensor, first_row: int, full_mask: int
    ) -> int:
        """Fill the rows of one request's root and scheduled nodes.

        grammar: vLLM's ``StructuredOutputGrammar`` of the request, at the state
        after the committed tokens (left there on return).
        node_tokens: tokens of nodes 1..n, a breadth-first prefix of the tree
        (n = len(node_tokens) <= num_nodes).
        bitmask: int32 [rows, ceil(V / 32)]; rows first_row .. first_row + n are
        written, row first_row + i for node i (the root is node 0).
        full_mask: the all-allowed word (-1), for rows after the grammar ended.
        Returns n + 1, the number of rows written.
        """
        scheduled = len(node_tokens)
        if scheduled > self.num_nodes:
            raise ValueError(f"{scheduled} draft tokens scheduled for a tree of {self.num_nodes} nodes")
        self._fill_below(grammar, request_id, 0, node_tokens, bitmask, first_row, full_mask, scheduled)
        return scheduled + 1

    def _fill_below(self, grammar, request_id, node, node_tokens, bitmask, first_row, full_mask, scheduled) -> None:
        row = first_row + node
        if grammar.is_terminated():
            bitmask[row].fill_(full_mask)
        else:
            grammar.fill_bitmask(bitmask, row)
        for child in self.children[node]:
            if child > scheduled:
                break  # children are numbered in increasing order; the rest are not scheduled
            token = node_tokens[child - 1]
            if (
                not grammar.is_terminated()
                and _allows(bitmask[row], token)
                and grammar.accept_tokens(request_id, [token])
            ):
                self._fill_below(grammar, request_id, child, node_tokens, bitmask, first_row, full_mask, scheduled)
                grammar.rollback(1)
            else:  # unreachable subtree: any valid rows will do
                rows = [first_row + v for v in self.subtree[child] if v <= scheduled]
                bitmask[rows] = bitmask[row].clone()


def _allows(row: torch.Tensor, token: int) -> bool:
    """Whether bitmask ``row`` (int32 words, bit t % 32 of word t // 32) allows ``token``."""
    word = token >> 5
    if token < 0 or word >= row.shape[0]:
        return False
    return (int(row[word]) >> (token & 31)) & 1 == 1


def tree_grammar_bitmask(
    manager,
    tree_bitmask: TreeGrammarBitmask,
    requests: dict,
    structured_output_request_ids: list[str],
    scheduled_spec_decode_tokens: dict,
):
    """``StructuredOutputManager.grammar_bitmask`` for tree drafts: the same
    result layout (rows of each structured request in ``structured_output_request_ids``
    order, 1 + scheduled nodes each) as an int32 numpy array.

    manager: vLLM's ``StructuredOutputManager``; its bitmask buffer is reused.
    """
    if manager._grammar_bitmask is None:
        max_batch = manager.vllm_config.scheduler_config.max_num_seqs
        manager._grammar_bitmask = manager.backend.allocate_token_bitmask(
            max_batch * (1 + manager.vllm_config.num_speculative_tokens)
        )
    bitmask = manager._grammar_bitmask
    next_row = 0
    for req_id in structured_output_request_ids:
        request = requests[req_id]
        if manager._get_constraint_bounds(request, ()).constraint_start != 0:
            # Refused per request (``request_options``); kept as a guard against silent errors.
            raise NotImplementedError("structured outputs after reasoning are not supported with tree speculation")
        grammar = request.structured_output_request.grammar
        node_tokens = list(scheduled_spec_decode_tokens.get(req_id, ()))
        next_row += tree_bitmask.fill(grammar, req_id, node_tokens, bitmask, next_row, manager._full_mask)
    return bitmask[:next_row].numpy()
