"""What one engine step leaves for the next: the drafted trees and the draft cache fill.

Requests are keyed by id, not batch row: vLLM reorders its batch between steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DraftedTrees:
    """The trees proposed at the end of one step, for the next step's verifier.

    tokens: LongTensor [B, N+1], node tokens (column 0 = the root; -1 = no node).
    draft_probs: FloatTensor [B, N+1, V], row i = q node i's children were drawn from.
    """

    req_ids: list[str]
    tokens: torch.Tensor
    draft_probs: torch.Tensor

    def rows_for(self, req_ids: list[str]) -> list[int]:
        """Row of each request in this batch; -1 where it has no tree."""
        index = {r: i for i, r in enumerate(self.req_ids)}
        return [index.get(r, -1) for r in req_ids]


@dataclass
class TreeState:
    """Per-request bookkeeping shared by the tree drafter and the tree verifier."""

    drafted: DraftedTrees | None = None
    # Leading positions of each request whose draft-model KV is in the cache.
    draft_kv_len: dict[str, int] = field(default_factory=dict)

    def forget_except(self, live_req_ids: list[str]) -> None:
        live = set(live_req_ids)
        self.draft_kv_len = {r: n for r, n in self.draft_kv_len.items() if r in live}
