"""The ``method: "univer"`` speculative-config fields: validation at config time."""

import pytest

from vllm_univer.integration.config import UniverConfig, split_user_config

pytestmark = pytest.mark.quick


def test_defaults_and_translation_to_vllm():
    ours, theirs = split_user_config({"method": "univer", "model": "draft"})
    assert ours.tree == "2x5" and ours.verifier == "univer" and ours.scheme == "topk1"
    assert theirs == {
        "method": "draft_model",
        "model": "draft",
        "num_speculative_tokens": 62,
        "draft_sample_method": "probabilistic",
    }


def test_paths_and_chain_verifiers():
    ours, theirs = split_user_config({"model": "d", "tree": [[0], [1], [0, 0]], "verifier": "traversal"})
    assert ours.tree_spec.num_nodes == 3 and theirs["num_speculative_tokens"] == 3
    assert split_user_config({"model": "d", "tree": "1x5", "verifier": "block"})[0].scheme == "chain"


def test_tree_auto_schedules_the_largest_tree():
    ours, theirs = split_user_config({"model": "d", "tree": "auto"})
    assert ours.auto and ours.tree_spec.num_nodes == 62 and theirs["num_speculative_tokens"] == 62
    ours, theirs = split_user_config({"model": "d", "tree": "auto", "max_tree": "1x4", "verifier": "token"})
    assert ours.tree_spec.is_chain and theirs["num_speculative_tokens"] == 4
    assert not split_user_config({"model": "d", "tree": "2x3"})[0].auto


@pytest.mark.parametrize(
    "spec,match",
    [
        ({"model": "d", "verifier": "medusa"}, "unknown verifier 'medusa'"),
        ({"model": "d", "tree": "2y5"}, "malformed tree"),
        ({"model": "d", "tree": "2x7"}, "at most 128"),
        ({"model": "d", "tree": [[0, 0]]}, "prefix"),
        ({"model": "d", "tree": "2x3", "verifier": "block"}, "single chain"),
        ({"model": "d", "tree": "2x3", "num_speculative_tokens": 5}, "disagrees with tree"),
        ({"tree": "2x3"}, "needs a draft model"),
        ({"model": "d", "tree": "2x3", "max_tree": "2x5"}, "max_tree applies to tree 'auto'"),
        ({"model": "d", "tree": "auto", "max_tree": "2z5"}, "malformed tree"),
        ({"model": "d", "tree": "auto", "verifier": "token"}, "single chain"),
        ({"model": "d", "tree": "2x3", "max_nodes": 16}, "max_nodes apply to tree 'dynamic'"),
        ({"model": "d", "tree": "dynamic", "verifier": "univer_wor"}, "does not run on context-aware trees"),
        ({"model": "d", "tree": "dynamic", "expand": 0}, "expand must be >= 1"),
        ({"model": "d", "tree": "dynamic", "max_nodes": 500}, "max_nodes 500"),
        ({"model": "d", "tree": "dynamic", "max_nodes": 8, "num_speculative_tokens": 9}, "disagrees with tree"),
        ({"model": "d", "tree": "auto", "max_tree": "1x3", "max_nodes": 8}, "must fit in max_tree"),
        ({"model": "d", "tree": "auto", "max_nodes": 8, "verifier": "traversal"}, "does not run on context-aware"),
        ({"model": "d", "tree": "auto", "cuda_graphs": "whole"}, "cuda_graphs"),
    ],
)
def test_bad_configs(spec, match):
    with pytest.raises(ValueError, match=match):
        split_user_config(spec)


def test_unknown_field_is_refused():
    with pytest.raises(ValueError, match="extra"):
        UniverConfig(tree="2x2", depth=3)


def test_tree_dynamic_lays_out_its_budget():
    from vllm_univer.core.dynamic_tree import DynamicTreeBudget, level_sizes

    ours, theirs = split_user_config({"model": "d", "tree": "dynamic"})
    layout = ours.drafted_tree
    assert ours.dynamic and not ours.auto and ours.scheme == "topk1"
    assert layout.level_sizes == level_sizes(DynamicTreeBudget())
    assert theirs["num_speculative_tokens"] == layout.num_nodes <= DynamicTreeBudget().max_nodes
    assert ours.tree_shapes == [layout]
    spec = {"model": "d", "tree": "dynamic", "max_nodes": 8, "max_depth": 4, "expand": 1, "max_children": 2}
    ours, theirs = split_user_config({**spec, "verifier": "target_only"})
    assert ours.dynamic_budget == DynamicTreeBudget(8, 4, 1, 2)
    assert ours.drafted_tree.level_sizes == (1, 2, 2, 2, 2) and theirs["num_speculative_tokens"] == 8
    with pytest.raises(ValueError, match="no single shape"):
        ours.tree_spec  # noqa: B018


def test_tree_auto_with_a_budget_adds_dynamic_trees():
    """Budget fields with tree "auto": the levels of context-aware trees join the
    candidates before max_tree (the sizer's fallback, still what vLLM schedules);
    max_nodes and max_depth default to max_tree's where the dynamic defaults are larger."""
    from vllm_univer.core.tree_batch import LevelLayout

    ours, theirs = split_user_config({"model": "d", "tree": "auto", "max_tree": "2x3", "expand": 2})
    chain, layout, full = ours.tree_shapes
    assert ours.auto_dynamic and not ours.dynamic and chain.is_chain and full == ours.tree_spec
    assert isinstance(layout, LevelLayout) and layout.max_depth == 3 and layout.num_nodes <= full.num_nodes
    assert ours.dynamic_budget.max_nodes == 14 and ours.dynamic_budget.max_depth == 3
    assert theirs["num_speculative_tokens"] == full.num_nodes
    plain, _ = split_user_config({"model": "d", "tree": "auto", "max_tree": "2x3"})
    assert not plain.auto_dynamic and len(plain.tree_shapes) == 2
