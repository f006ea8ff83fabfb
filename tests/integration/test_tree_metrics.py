"""The histogram of draft nodes per request per step, from vLLM's per-position draft counts."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm_univer.core.tree import TreeSpec  # noqa: E402
from vllm_univer.integration.tree_metrics import cut_sizes, drafts_by_size  # noqa: E402


def test_buckets_are_the_cut_sizes():
    assert cut_sizes([TreeSpec.parse("2x3")]) == [2, 6, 14]
    assert cut_sizes([TreeSpec.parse("1x4")]) == [1, 2, 3, 4]
    assert cut_sizes([TreeSpec.parse([[0], [1], [2], [0, 0], [1, 0], [0, 0, 0]])]) == [3, 5, 6]
    # tree "auto": every width cut's depth cuts (2x3: the chain 1x3, then 2x3).
    assert cut_sizes(TreeSpec.parse("2x3").width_cuts()) == [1, 2, 3, 6, 14]


def test_draft_sizes_from_per_position_counts():
    # 5 drafts: sizes 1, 1, 3, 3, 4 -> more than 0 nodes: 5, more than 1: 3, more than 2: 3, more than 3: 1.
    assert drafts_by_size([5, 3, 3, 1]) == {1: 2, 3: 2, 4: 1}
    assert drafts_by_size([0, 0, 0]) == {}
    assert drafts_by_size([2, 2, 2]) == {3: 2}
