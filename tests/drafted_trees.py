"""Draft trees with the package's own drafter, for tests that verify them."""

from __future__ import annotations

import torch

from vllm_univer import draft_children


def drafted_tokens(tree, q: torch.Tensor, scheme: str, generator: torch.Generator) -> torch.Tensor:
    """q [B, N+1, V] (each node's draft row) -> tokens [B, N+1]: one tree per row of
    ``tree``'s shape drawn with ``scheme`` (``draft_children``), breadth-first; a child
    that cannot exist (-1) takes its subtree with it; column 0 (the root) is -1."""
    tokens = torch.full(q.shape[:2], -1, dtype=torch.long)
    for v in range(tree.num_nodes + 1):  # breadth-first: a parent's token is drawn before its children
        kids = [c for c in tree.children[v].tolist() if c >= 0]
        if kids:
            drawn = draft_children(scheme, q[:, v], len(kids), generator=generator)
            if v > 0:
                drawn[tokens[:, v] < 0] = -1
            tokens[:, kids] = drawn
    return tokens
