"""The draft forwards' CUDA-graph path (``integration/draft_forward.py``) on CPU.

On a GPU the tree drafter replays vLLM's piecewise graphs of the draft model: its
inputs go into the proposer's persistent buffers, padded to a captured size, the
padding tokens' cache slots at -1, and only the real rows of the hidden states
are read back. Here the proposer's dispatcher is made to pad every forward the
same way (eagerly: the CPU has no graphs), and the engine must draft exactly the
same trees and return exactly the same tokens as with unpadded forwards: a digest
of every tree drafted and every verification outcome, for a chain (causal level
attention) and trees (the tree plan's masked attention), prompts of many lengths
(level 0 runs whole prompts after prefill), greedy requests (draws are the top
tokens: a wrong input, position or slot changes them).

On a GPU, ``test_trees_drafted_under_cuda_graphs`` runs the real thing: engines
with vLLM's piecewise CUDA graphs for target and draft.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from engine_job import CUDA_GRAPHS, run_engines  # noqa: E402
from greedy_identity import assert_greedy_identical  # noqa: E402
from test_engine import AUTO_SCHEDULE, auto, call, engine, prompts, reference, univer  # noqa: E402

CASES = [("univer", "2x3"), ("traversal", "3x2"), ("token", "1x4")]


def test_padded_draft_forwards_draft_the_same_trees(tiny_pair):
    target, draft = tiny_pair
    job = call(prompts(6, seed=3), temperature=0.0, max_tokens=40, ignore_eos=True)
    engines = []
    for method, tree in CASES:
        plain = {**engine(target, [job], univer(draft, tree, method)), "rank_decisions": True}
        engines += [plain, {**plain, "draft_padding": 8}]
    results = run_engines(engines)
    for (method, tree), plain, padded in zip(CASES, results[::2], results[1::2]):
        label = (method, tree)
        assert plain["calls"][0]["outputs"] == padded["calls"][0]["outputs"], label
        assert all(len(o) == 40 for o in padded["calls"][0]["outputs"]), label
        # Most forwards were padded (a level of 8 tokens is not), and what was drafted did not change.
        assert padded["padded_forwards"] > 10, (label, padded["padded_forwards"])
        assert plain["rank_decisions"][0]["steps"] > 20, label
        assert plain["rank_decisions"] == padded["rank_decisions"], label
        # After the prompts, level 0 runs each request's root, and the last accepted node where the
        # path ended on a leaf: the draft cache's lengths follow every verification.
        level0 = plain["rank_decisions"][0]["level0_tokens"]
        assert level0[0][0] > 6 * 10, (label, level0[0])
        assert all(tokens <= 2 * requests for tokens, requests in level0[1:]), (label, level0)


def _chunked_mixed_job(seed: int) -> tuple[dict, dict]:
    """Six prompts, greedy and sampled requests of 40 tokens, and engine options that
    prefill them in chunks beside decoding trees: (job, engine kwargs)."""
    greedy = {"temperature": 0.0, "max_tokens": 40, "ignore_eos": True}
    sampled = {"temperature": 1.0, "max_tokens": 40, "ignore_eos": True}
    job = {"prompts": prompts(6, seed=seed), "params": [greedy, sampled, greedy, sampled, greedy, greedy]}
    return job, {"max_num_batched_tokens": 48, "enable_chunked_prefill": True, "max_num_seqs": 6}


def _chain_tree_dynamic(draft: str) -> list[dict]:
    """A chain (causal levels), a static tree, context-aware trees."""
    return [
        univer(draft, "1x4", "token"),
        univer(draft, "2x3"),
        {**univer(draft, "dynamic"), "max_nodes": 8, "max_depth": 4, "expand": 2, "max_children": 2},
    ]


def test_drafting_waits_for_no_verified_token(tiny_pair):
    """The drafter launches every draft forward before the host reads anything the
    step's verification produced (on a GPU the host then prepares the drafts while
    the device still verifies): with each host read of the sampled tokens, or of any
    tensor computed from them, an error until the launch, the engines draft the
    same trees and generate the same tokens. A chain, a tree, context-aware trees and
    tree auto's cuts; greedy and sampled requests; prompts prefilled in chunks.
    Let through: ``top_tokens``' tie check (k >= 2), made on a CPU only (on a GPU
    it is a Triton kernel, ``top_tokens_fused``, tested in ``test_fused_drafting``)."""
    target, draft = tiny_pair
    job, kw = _chunked_mixed_job(seed=4)
    configs = [
        *_chain_tree_dynamic(draft),
        {**auto(draft, "2x3"), "max_nodes": 10, "expand": 2},  # cuts of 2x3, its chains and dynamic trees
    ]
    engines = []
    for config in configs:
        plain = {**engine(target, [job], config, **kw), "rank_decisions": True}
        engines += [plain, {**plain, "blind_drafting": True}]
    # tree auto: a fixed cycle of depth cuts (0: no tree, the draft cache then catches up) and shapes.
    results = run_engines(engines, env={**AUTO_SCHEDULE, "VLLM_UNIVER_AUTO_WIDTHS": "0,2,1,0"})
    for config, plain, blind in zip(configs, results[::2], results[1::2]):
        label = config["tree"]
        assert "error" not in blind and "error" not in blind["calls"][0], (label, blind)
        assert blind["blind_drafts"]["steps"] > 10, (label, blind["blind_drafts"])
        assert plain["calls"][0]["outputs"] == blind["calls"][0]["outputs"], label
        assert plain["rank_decisions"][0]["digest"] == blind["rank_decisions"][0]["digest"], label
    # The chain's draws are argmax rows: no read at all (top_tokens reads only for k >= 2).
    assert results[1]["blind_drafts"]["exempt_reads"] == 0, results[1]["blind_drafts"]


def test_dynamic_levels_run_only_the_nodes_they_expand(tiny_pair):
    """tree "dynamic": a level's forward runs only its ``expand`` best nodes (the only
    ones that get children): the same trees, the same tokens as running every node
    of the level (greedy and sampled requests, prompts in chunks), in fewer draft rows."""
    target, draft = tiny_pair
    job, kw = _chunked_mixed_job(seed=8)
    config = {**univer(draft, "dynamic"), "max_nodes": 12, "max_depth": 4, "expand": 2, "max_children": 3}
    plain = {**engine(target, [job], config, **kw), "rank_decisions": True}
    kept, every = run_engines([plain, {**plain, "run_every_node": True}])
    assert "error" not in kept and "error" not in every["calls"][0], (kept, every)
    assert kept["calls"][0]["outputs"] == every["calls"][0]["outputs"]
    assert kept["rank_decisions"][0]["digest"] == every["rank_decisions"][0]["digest"]
    assert kept["rank_decisions"][0]["steps"] > 20
    # Levels 2 and 3 hold 6 nodes per request (2 expanded x 3 children): 2 of them run.
    rows_kept = sum(kept["rank_decisions"][0]["draft_rows"])
    rows_every = sum(every["rank_decisions"][0]["draft_rows"])
    assert rows_kept < 0.75 * rows_every, (rows_kept, rows_every)


def test_level_forwards_under_full_graphs(tiny_pair):
    """``"cuda_graphs": "full"``: a level forward whose requests all run as many
    tokens replays one graph of the draft model (``DraftLevelGraphs``), its tokens,
    positions, slots and tree plan in persistent buffers. Emulated here: each
    graph's replay reruns the captured region on those buffers, under
    ``GraphDiscipline``, which must see no host sync, no copy between devices, no
    tensor filled from host values, and the same storages read at every replay of
    a size. Then the engine drafts the same trees and generates the same tokens as
    without graphs: a chain (causal levels), trees, context-aware trees; greedy and
    sampled requests, prompts prefilled in chunks (level 0 of a prompt is not
    uniform: it keeps the piecewise path)."""
    target, draft = tiny_pair
    job, kw = _chunked_mixed_job(seed=5)
    configs = _chain_tree_dynamic(draft)
    engines = []
    for config in configs:
        plain = {**engine(target, [job], config, **kw), "rank_decisions": True}
        engines += [plain, {**plain, "draft_graphs": "emulate"}]
    results = run_engines(engines)
    for config, plain, graphs in zip(configs, results[::2], results[1::2]):
        label = config["tree"]
        assert "error" not in graphs and "error" not in graphs["calls"][0], (label, graphs)
        checks = graphs["draft_graphs"]
        assert checks["violations"] == [] and checks["unstable_inputs"] == 0, (label, checks)
        assert checks["replays"] > 40 and checks["runs"] >= checks["replays"], (label, checks)
        assert plain["calls"][0]["outputs"] == graphs["calls"][0]["outputs"], label
        assert plain["rank_decisions"][0]["digest"] == graphs["rank_decisions"][0]["digest"], label


def test_whole_full_graph_path_emulated(tiny_pair):
    """``"cuda_graphs": "full"`` as a whole, emulated on CPU: the target's uniform
    batches dispatched as under full CUDA graphs (``engine_job._target_graphs``:
    vLLM's FULL keys for whole trees and, with ``tree: auto``, this package's for
    each cut's length, ``full_graph_lengths``; padded to the graph's batch size,
    attention metadata padded, tree rows planned in the graph's buffers), the draft
    levels and the verification replayed from their graphs' buffers. Greedy tokens
    are the target's alone, trees are accepted as often as without graphs (rows
    planned on stale buffers would reject them); 2x3, dynamic trees and ``tree:
    auto`` cut per step (one cut for every request), whose uniform batches ran the
    target's forwards of each cut's length (a cut's tree rows planned causal, as a
    chain's, fails it)."""
    target, draft = tiny_pair
    job = call(prompts(6, seed=3), temperature=0.0, max_tokens=40, ignore_eos=True)
    configs = [
        univer(draft, "2x3"),
        {**univer(draft, "dynamic"), "max_nodes": 8, "max_depth": 4, "expand": 2, "max_children": 2},
        auto(draft, "2x3"),
    ]
    graphs = {"draft_graphs": "emulate", "verify_graphs": "emulate", "target_graphs": "emulate"}
    engines = [reference(target, [job])]
    for config in configs:
        engines += [engine(target, [job], config), {**engine(target, [job], config), **graphs}]
    # tree auto, one cut per step: 2x3 to depth 2, 1, 0, its chain to 3, 2x3 whole; 3 steps in 5 trees.
    schedule = {"VLLM_UNIVER_AUTO_DEPTHS": "2,1,0,3,3", "VLLM_UNIVER_AUTO_WIDTHS": "2,2,2,1,2"}
    results = run_engines(engines, env={**schedule, "VLLM_UNIVER_AUTO_ONE_DEPTH": "1"})
    for config, plain, full in zip(configs, results[1::2], results[2::2]):
        label = f"univer {config['tree']} under emulated full graphs"
        assert "error" not in full and "error" not in full["calls"][0], (label, full)
        assert_greedy_identical(full["calls"][0]["outputs"], results[0]["calls"][0], label)
        forwards = {int(length): count for length, count in full["target_graphs"].items()}
        if config["tree"] == "auto":  # 1 + the nodes of 2x3 cut to depths 0, 1, 2, 3 and of its chain cut to 3
            assert set(forwards) == {1, 3, 4, 7, 15}, (label, forwards)
        else:  # whole trees: vLLM's own graphs (2x3: 15 positions; the dynamic trees' levels: 9)
            assert len(forwards) == 1 and sum(forwards.values()) > 20, (label, forwards)
        for kind in ("draft_graphs", "verify_graphs"):
            checks = full[kind]
            assert checks["violations"] == [] and checks["unstable_inputs"] == 0, (label, kind, checks)
            assert checks["replays"] > 10, (label, kind, checks)

        def accepted_per_draft(result):
            spec = result["spec"]
            return spec["vllm:spec_decode_num_accepted_tokens"] / spec["vllm:spec_decode_num_drafts"]

        assert abs(accepted_per_draft(full) - accepted_per_draft(plain)) <= 0.05 * accepted_per_draft(plain), (
            label,
            full["spec"],
            plain["spec"],
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (benchmarks/gpu_engine.sh graphs)")
def test_trees_drafted_under_cuda_graphs(tiny_pair):
    """Target and draft replaying CUDA graphs: greedy tokens are the target's alone
    (a reference under graphs too), and the trees drafted are accepted as often as
    an eager engine's (a draft forward replayed on stale inputs would draft trees
    the target rejects)."""
    target, draft = tiny_pair
    job = call(prompts(6, seed=3), temperature=0.0, max_tokens=60, ignore_eos=True)
    spec = univer(draft, "2x3")
    results = run_engines(
        [
            reference(target, [job], **CUDA_GRAPHS),
            engine(target, [job], spec, **CUDA_GRAPHS),
            engine(target, [job], spec, enforce_eager=True),
        ]
    )
    graphs, eager = results[1], results[2]
    assert "error" not in graphs, graphs.get("error")
    assert_greedy_identical(graphs["calls"][0]["outputs"], results[0]["calls"][0], "univer 2x3 under CUDA graphs")
    assert_greedy_identical(eager["calls"][0]["outputs"], results[0]["calls"][0], "univer 2x3 eager")

    def accepted_per_draft(result):
        spec = result["spec"]
        return spec["vllm:spec_decode_num_accepted_tokens"] / spec["vllm:spec_decode_num_drafts"]

    # Greedy drafts of one draft model: the same trees but for float rounding near ties.
    assert accepted_per_draft(eager) > 0.3, eager["spec"]  # 0.49 on CPU, 2026-12-05
    assert abs(accepted_per_draft(graphs) - accepted_per_draft(eager)) <= 0.05 * accepted_per_draft(eager), (
        graphs["spec"],
        eager["spec"],
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (benchmarks/gpu_engine.sh graphs)")
@pytest.mark.parametrize("tree", ["2x3", "dynamic", "auto"])
def test_whole_trees_under_full_cuda_graphs(tiny_pair, tree):
    """``"cuda_graphs": "full"``: batches of whole trees replay one full graph of the
    target forward (tree attention over the captured size's buffers), mixed batches
    the piecewise graphs; the draft's uniform level forwards replay full graphs of
    the draft model (``DraftLevelGraphs``), the argmax matching its own
    (``VerifyGraphs.verify_greedy``). ``tree: auto`` cut per step (depths 3, 0, 2,
    1 of 2x3 and its chain, one depth per step): each cut's uniform batches replay
    the target's graph of its length (``full_graph_lengths``). Greedy tokens are the
    target's alone, and trees are accepted as often as under piecewise graphs (a
    replay on stale plan buffers would reject them)."""
    target, draft = tiny_pair
    job = call(prompts(6, seed=3), temperature=0.0, max_tokens=60, ignore_eos=True)
    spec = auto(draft, "2x3") if tree == "auto" else univer(draft, tree)
    results = run_engines(
        [
            reference(target, [job], **CUDA_GRAPHS),
            {
                **engine(target, [job], {**spec, "cuda_graphs": "full"}, **CUDA_GRAPHS),
                "draft_graphs": "report",
                "verify_graphs": "report",
                "target_graphs": True,
            },
            engine(target, [job], spec, **CUDA_GRAPHS),
        ],
        env={**AUTO_SCHEDULE, "VLLM_UNIVER_AUTO_ONE_DEPTH": "1"},  # auto: every cut of 2x3 and 1x3 in turn
    )
    full, piecewise = results[1], results[2]
    assert "error" not in full, full.get("error")
    assert full["draft_graphs"]["replays"] > 100, full["draft_graphs"]
    assert full["verify_graphs"]["replays"] > 20, full["verify_graphs"]  # argmax matching (all greedy)
    if tree == "auto":  # 1 + the nodes of 2x3 cut to depths 0..3 and of its chain 1x3 cut to 1..3
        assert set(full["target_graphs"]) >= {"1", "2", "3", "4", "7", "15"}, full["target_graphs"]
    else:
        assert sum(full["target_graphs"].values()) > 20, full["target_graphs"]
    assert_greedy_identical(full["calls"][0]["outputs"], results[0]["calls"][0], f"univer {tree} under full graphs")

    def accepted_per_draft(result):
        spec = result["spec"]
        return spec["vllm:spec_decode_num_accepted_tokens"] / spec["vllm:spec_decode_num_drafts"]

    assert abs(accepted_per_draft(full) - accepted_per_draft(piecewise)) <= 0.05 * accepted_per_draft(piecewise), (
        full["spec"],
        piecewise["spec"],
    )
