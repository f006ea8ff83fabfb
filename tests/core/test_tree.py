"""TreeSpec: parsing, numbering, and malformed trees."""

import pytest

from vllm_univer import MAX_TREE_NODES, TreeSpec

pytestmark = pytest.mark.quick


def test_balanced_shapes():
    t = TreeSpec.parse("2x5")
    assert t.num_nodes == 62 and t.max_depth == 5
    assert TreeSpec.parse("3x3").num_nodes == 39
    chain = TreeSpec.parse("1x5")
    assert chain.num_nodes == 5 and chain.is_chain
    assert chain.parent.tolist() == [-1, 0, 1, 2, 3, 4]


def test_numbering_is_breadth_first():
    t = TreeSpec.from_paths([(0, 0, 0), (1,), (0,), (0, 1), (0, 0)])
    assert t.paths == ((), (0,), (1,), (0, 0), (0, 1), (0, 0, 0))
    assert t.parent.tolist() == [-1, 0, 0, 1, 1, 3]
    assert t.depth.tolist() == [0, 1, 1, 2, 2, 3]
    assert t.slot.tolist() == [-1, 0, 1, 0, 1, 0]
    assert all(t.parent[i] < i for i in range(1, t.num_nodes + 1))
    assert t.children.tolist() == [[1, 2], [3, 4], [-1, -1], [5, -1], [-1, -1], [-1, -1]]
    # post-order, sampled child (slot 0) first: 5 3 4 1 2 0
    assert t.postorder_rank.tolist() == [5, 3, 4, 1, 2, 0]
    assert t.ancestor_mask[5].tolist() == [True, True, False, True, False, True]


def test_even_pairs_reads_sibling_subtree_sizes():
    assert TreeSpec.parse("2x5").even_pairs and TreeSpec.parse("3x3").even_pairs
    # Slot 2 pairs with no one: 3x3 stays even; a lone child is no pair.
    assert TreeSpec.from_paths([(0,), (0, 0)]).even_pairs
    # The root's pair carries subtrees of 2 and 1 nodes.
    assert not TreeSpec.from_paths([(0,), (1,), (0, 0)]).even_pairs
    # Even at the root (4 and 4 nodes), uneven below: node (0,)'s slots hold 2 and 1 nodes.
    uneven_below = [(0,), (1,), (0, 0), (0, 1), (0, 0, 0), (1, 0), (1, 1), (1, 1, 0)]
    assert not TreeSpec.from_paths(uneven_below).even_pairs
    assert TreeSpec.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1)]).even_pairs
    # Slots (2, 3) uneven while (0, 1) are even.
    assert not TreeSpec.from_paths([(0,), (1,), (2,), (3,), (2, 0)]).even_pairs


def test_parse_accepts_paths_and_trees():
    paths = [[0], [1], [0, 0]]
    assert TreeSpec.parse(paths) == TreeSpec.from_paths(paths)
    t = TreeSpec.parse("2x2")
    assert TreeSpec.parse(t) is t


@pytest.mark.parametrize(
    "spec,match",
    [
        ("2y5", "malformed tree"),
        ("0x3", "must be >= 1"),
        ("2x7", f"at most {MAX_TREE_NODES}"),
        ([(0,), (0, 0, 0)], "prefix"),
        ([(1,)], "slot 0"),
        ([(0,), (0,)], "twice"),
        ([()], "empty path"),
        ([(0, -1)], "negative"),
        ([], "no draft nodes"),
        ([("a",)], "not a sequence of integers"),
    ],
)
def test_malformed(spec, match):
    with pytest.raises(ValueError, match=match):
        TreeSpec.parse(spec)


def test_size_limit_on_paths():
    paths = [(i,) for i in range(MAX_TREE_NODES + 1)]
    with pytest.raises(ValueError, match="at most"):
        TreeSpec.from_paths(paths)
    assert TreeSpec.from_paths(paths[:-1]).num_nodes == MAX_TREE_NODES
