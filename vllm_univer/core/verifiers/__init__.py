"""Registry of the tree verifiers."""

from __future__ import annotations

from .base import Family, NodeBatch, NodeOutput, TreeVerifier
from .block import BlockVerifier
from .greedy import GreedyOTVerifier
from .rrs import RecursiveRejectionVerifier
from .target_only import TargetOnlyVerifier
from .token_level import TokenVerifier
from .traversal import TraversalVerifier
from .univer import UniVerVerifier
from .univer_wor import UniVerWorVerifier

_VERIFIERS: dict[str, TreeVerifier] = {
    v.name: v
    for v in (
        TokenVerifier(),
        BlockVerifier(),
        RecursiveRejectionVerifier(without_replacement=False),
        RecursiveRejectionVerifier(without_replacement=True),
        TraversalVerifier(),
        GreedyOTVerifier(),
        TargetOnlyVerifier(),
        UniVerVerifier(),
        UniVerWorVerifier(),
    )
}

METHODS: tuple[str, ...] = (
    "token",
    "block",
    "rrs",
    "rrsw",
    "traversal",
    "greedy",
    "target_only",
    "univer",
    "univer_wor",
)
assert set(METHODS) == set(_VERIFIERS)


def get_verifier(method: str) -> TreeVerifier:
    """The verifier called ``method``; ValueError naming the choices otherwise."""
    try:
        return _VERIFIERS[method]
    except (KeyError, TypeError):
        raise ValueError(f"unknown verifier {method!r}; choose one of {', '.join(METHODS)}") from None


def scheme_for(method: str) -> str:
    """The draft scheme that ``method`` is lossless with (and that the engine drafts with)."""
    return get_verifier(method).scheme


__all__ = [
    "METHODS",
    "Family",
    "NodeBatch",
    "NodeOutput",
    "TreeVerifier",
    "get_verifier",
    "scheme_for",
]
