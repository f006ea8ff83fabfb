"""The engine on its CUDA code paths, run on CPU by Triton's interpreter: the
fused drafting (``draft_children_fused``), the fused verify (``fused_node_weights`` /
``fused_finish``; univer_wor's ``fused_wor_step``) and the CPU paths give a
mixed batch's greedy requests the same tokens (argmax matching in the finish
kernel, top tokens in the drafting kernel), and the sampled requests run through the fused kernels in the engine
(their laws are the kernels' tests' and gpu_check's); and the launches per
step on those paths (ATen ops + Triton launches) stay within a budget. The CUDA-only switches
(``triton_reads``) are forced on in a subprocess; the KV moves stay on the CPU
path (the CPU attention's key layout is transposed; test_fused_kv_moves.py
checks the kernel on the CUDA layouts).
"""

from __future__ import annotations

import textwrap

import pytest
from triton_interpreter import run_interpreted

pytest.importorskip("triton")
pytest.importorskip("vllm")

# Kernel launches per engine step on the CUDA code paths (ATen ops + Triton launches,
# KV moves aside), mixed batch of 4, tree 2x3, tiny models: the package's share of
# a GPU step that test_op_budgets.py guards for the CPU paths.
# 2026-12-02: 120 (verify 47, draft 61, target_probs 3, verifier 3, Triton 6.5). 2026-12-05: the
# drafting kernel writes the children into the token table itself (5 launches per child group
# fewer): 123 -> 105 (verify 47, draft 44, target_probs 4, verifier 3, Triton 6.5). Then 95: the output
# row padded only when a cut is shallower, the cut mask built on the host, the level plans' index
# ranges views of one kept range, the greedy flags uploaded as the kernel's int8 (verify 42, draft 40).
# 2026-12-06: 112 (draft 40 -> 71): the drafter places every level's positions, slots and level 0's
# tokens on the device from the accepted count (``draft_inputs``, ~25 small ops, and the new-token
# counts), so the host no longer waits for the verification before launching the draft forwards;
# 2026-12-06 (later): 90 (draft 71 -> 48): that placement is one Triton launch (``triton_draft_inputs``).
# 2026-12-07: 98, the target forward's tree plan counted too ("tree_plan", 9: positions, masks and
# index tensors uploaded, there before and not counted).
CUDA_STEP_BUDGET = 101
# univer_wor (its kernels: one launch per level and one for the draw), 2026-12-05: 139, then 121 with
# the children written by the drafting kernel (verify 47, draft 44, target_probs 3, verifier 20: the
# decision, greedy rows and output rows; Triton 6.5); 111 with univer's cuts above.
# 2026-12-06: 127, the drafter's placement on the device as above; then 105, that placement in one launch.
# 2026-12-07: 113 with the tree plan counted (as above); 127 with issue 61's guard
# (lone_child_where_near_sure: ~14 ops a step, which the kernels' first pass could fold in).
CUDA_STEP_BUDGET_WOR = 130
# tree "dynamic" (8 nodes on levels 2 / 4 / 2, depth 3), 2026-12-06: 805 with the PyTorch draws
# (draft 494), 555 with each level's draws and greedy rows in one launch (draft 245: the planning,
# placement and masks, ~80 ops per level). Then 302: the fused verify kernels read each request's
# own tree tables (verifier 270 -> 12, verify 29 -> 33, Triton launches 7.0 -> 8.8).
# 2026-12-07: 383 with the tree plan counted ("tree_plan" 81: the per-request trees' tables, built
# for the attention masks before the forward and read again by the verifier).
CUDA_STEP_BUDGET_DYNAMIC = 386
# The same mixed batch under "cuda_graphs": "full" (the target's, the draft levels' and the
# verification's graphs emulated): launches outside the graphs plus one per replay.
# 2026-12-07: univer 95 (verify 13 + 1 replay, drafting 43 + 3 level replays, tree plan 24: the
# eager path's plan and the graph's buffers written, Triton 6.5), univer_wor 93; the forwards
# included. Without full graphs: 98 / 113 above, the forwards not included (under piecewise graphs
# a graph piece and an attention call per layer: ~3 x 28 for a 7B target, ~3 x 24 per draft level).
FULL_GRAPH_STEP_BUDGET = {"univer": 98, "univer_wor": 96}

SCRIPT = textwrap.dedent("""
    import json
    import sys
    from vllm import LLM, SamplingParams
    from vllm_univer.core import api, fused_tree_pass
    from vllm_univer.integration import draft_inputs, dynamic_tree_drafter, tree_drafter
    from vllm_univer.core.kernels import triton_draft_children
    from engine_job import _op_counts

    target, draft, CUDA_STEP_BUDGET, verifier = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
    tree = json.loads(sys.argv[5])  # the tree fields of the speculative config
    dynamic = tree["tree"] == "dynamic"  # per-request trees: the PyTorch verify rules (no fused verify yet)
    llm = LLM(model=target, max_model_len=256, dtype="float32", enforce_eager=True, block_size=32, seed=0,
              speculative_config={"method": "univer", "model": draft, "verifier": verifier, **tree})
    prompts = ["the tree draft token", "red blue green", "one two three four five", "a cat and a dog run"]
    temperatures = [0.0, 1.0, 0.0, 0.7]
    allowed = list(range(10, 300, 3))  # the last request drafts and samples inside this set
    params = [SamplingParams(temperature=t, max_tokens=12, ignore_eos=True) for t in temperatures]
    params[3] = SamplingParams(temperature=0.7, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed)

    greedy = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * len(prompts)

    def run(params=params):
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    cpu_paths, cpu_greedy = run(), run(greedy)
    launches = {"draft": 0, "verify": 0}
    draft_fused = triton_draft_children.draft_children_fused
    verify_entry = "fused_wor_step" if verifier == "univer_wor" else "fused_node_weights"
    original = getattr(api, verify_entry)

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            launches[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    # What CUDA would launch: the package's ATen ops (the engine's op counter) plus
    # the Triton launches, the interpreter's own tensor work hidden from the counter.
    from torch.utils._python_dispatch import _disable_current_modes
    from triton.runtime.interpreter import InterpretedFunction

    interpreted_run = InterpretedFunction.run
    triton_launches = []

    def launch(self, *args, **kwargs):
        triton_launches.append(self.__name__)
        with _disable_current_modes():
            return interpreted_run(self, *args, **kwargs)

    InterpretedFunction.run = launch

    llm.collective_rpc(_op_counts, args=(True,))
    fused_tree_pass.triton_reads = lambda *rows: all(r.stride(-1) == 1 for r in rows)
    tree_drafter.triton_reads = draft_inputs.triton_reads = fused_tree_pass.triton_reads
    dynamic_tree_drafter.triton_reads = fused_tree_pass.triton_reads
    triton_draft_children.draft_children_fused = counting("draft", draft_fused)
    setattr(api, verify_entry, counting("verify", original))
    fused_paths = run()
    assert launches["draft"] > 0 and (launches["verify"] > 0 or dynamic), launches
    assert set(fused_paths[3]) <= set(allowed), fused_paths[3]
    for t, a, b in zip(temperatures, cpu_paths, fused_paths):
        assert len(b) == 12
        if t == 0.0:
            assert a == b, (a, b)
    counts = llm.collective_rpc(_op_counts, args=(True,))[0]
    steps = counts["verify"]["calls"]
    # KV moves take the CPU path here (the CPU cache layout); on CUDA one launch.
    own = {s: c["kernels"] / steps for s, c in counts.items() if s not in ("draft_forward", "kv_moves")}
    per_step = sum(own.values()) + len(triton_launches) / steps
    syncs = sum(c["syncs"] for s, c in counts.items() if s not in ("draft_forward", "kv_moves")) / steps
    print({s: round(v) for s, v in own.items()}, "triton launches per step", len(triton_launches) / steps)
    print(f"per step {per_step:.0f} launches, {syncs:.1f} host syncs")
    assert per_step <= CUDA_STEP_BUDGET, per_step
    print("FUSED ENGINE OK", launches)
""")


DYNAMIC = {"tree": "dynamic", "max_nodes": 8, "max_depth": 4, "expand": 2, "max_children": 2}


@pytest.mark.parametrize(
    "verifier,tree,budget",
    [
        ("univer", {"tree": "2x3"}, CUDA_STEP_BUDGET),
        ("univer_wor", {"tree": "2x3"}, CUDA_STEP_BUDGET_WOR),
        ("univer", DYNAMIC, CUDA_STEP_BUDGET_DYNAMIC),
    ],
    ids=["univer", "univer_wor", "dynamic"],
)
def test_engine_on_the_fused_paths_keeps_greedy_outputs(tiny_pair, verifier, tree, budget):
    import json

    from engine_job import ENV

    out = run_interpreted(
        SCRIPT,
        "FUSED ENGINE OK",
        *tiny_pair,
        str(budget),
        verifier,
        json.dumps(tree),
        env={**ENV, "VLLM_UNIVER_OP_COUNTS": "1"},
        timeout=1500,
    )
    print(out[-600:])


GRAPHS_SCRIPT = textwrap.dedent("""
    import sys
    from vllm import LLM, SamplingParams
    from vllm_univer.core import fused_tree_pass
    from vllm_univer.integration import draft_inputs, tree_drafter
    from engine_job import _op_counts, _target_graphs, checked_capture

    target, draft, verifier, FULL_GRAPH_STEP_BUDGET = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    llm = LLM(model=target, max_model_len=256, dtype="float32", enforce_eager=True, block_size=32, seed=0,
              speculative_config={"method": "univer", "model": draft, "verifier": verifier, "tree": "2x3"})
    prompts = ["the tree draft token", "red blue green", "one two three four five", "a cat and a dog run"]
    temperatures = [0.0, 1.0, 0.0, 0.7]
    params = [SamplingParams(temperature=t, max_tokens=12, ignore_eos=True) for t in temperatures]

    greedy = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * len(prompts)

    def run(params=params):
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    cpu_paths, cpu_greedy = run(), run(greedy)
    fused_tree_pass.triton_reads = lambda *rows: all(r.stride(-1) == 1 for r in rows)
    tree_drafter.triton_reads = draft_inputs.triton_reads = fused_tree_pass.triton_reads

    # What CUDA would launch per step under full graphs: the package's ATen ops and Triton
    # launches outside the graphs (the op counter's sections), one per graph replay (the
    # region's own work hidden from the counter), and the target forward's replay.
    from torch.utils._python_dispatch import _disable_current_modes
    from triton.runtime.interpreter import InterpretedFunction

    launched = {"triton": 0, "replays": 0, "inside": 0}
    interpreted_run = InterpretedFunction.run

    def launch(self, *args, **kwargs):
        launched["triton"] += not launched["inside"]
        with _disable_current_modes():
            return interpreted_run(self, *args, **kwargs)

    InterpretedFunction.run = launch

    def one_launch_per_replay(capture):
        def hidden(run):
            launched["inside"] += 1
            try:
                with _disable_current_modes():
                    return run()
            finally:
                launched["inside"] -= 1

        def counted(fn):
            replay, output = hidden(lambda: capture(fn))  # the warm-up and the capture: once per size

            def counted_replay():
                launched["replays"] += 1
                hidden(replay)

            return counted_replay, output

        return counted

    def attach(worker):
        univer = worker.model_runner.tree_speculation
        univer.checks = {"draft": {}, "verify": {}}
        univer.use_draft_level_graphs(one_launch_per_replay(checked_capture(univer.checks["draft"])))
        univer.use_verify_graphs(one_launch_per_replay(checked_capture(univer.checks["verify"], constant_fills=True)))
        _target_graphs(worker)

    def checks(worker):
        univer = worker.model_runner.tree_speculation
        replays = {"draft": univer.drafter.level_graphs.replays, "verify": univer.sampler.verify_graphs.replays}
        return {kind: {**c, "replays": replays[kind]} for kind, c in univer.checks.items()}

    llm.collective_rpc(attach)
    llm.collective_rpc(_op_counts, args=(True,))
    launched.update(triton=0, replays=0)
    graph_paths = run()
    counts = llm.collective_rpc(_op_counts, args=(True,))[0]
    steps = counts["verify"]["calls"]
    # KV moves take the CPU path here (the CPU cache layout); on CUDA one launch, outside the graphs.
    own = {s: c["kernels"] / steps for s, c in counts.items() if s not in ("draft_forward", "kv_moves")}
    per_step = sum(own.values()) + (launched["triton"] + launched["replays"]) / steps + 1  # + the target's replay
    print({s: round(v) for s, v in own.items()}, "triton launches per step", launched["triton"] / steps,
          "replays per step", launched["replays"] / steps)
    print(f"full graphs: per step {per_step:.0f} launches")
    assert per_step <= FULL_GRAPH_STEP_BUDGET, per_step
    for t, a, b in zip(temperatures, cpu_paths, graph_paths):
        assert len(b) == 12
        if t == 0.0:
            assert a == b, (a, b)
    sampled = llm.collective_rpc(checks)[0]["verify"]["replays"]
    assert run(greedy) == cpu_greedy  # all-greedy steps: argmax matching replayed (verify_greedy)
    found = llm.collective_rpc(checks)[0]
    assert found["verify"]["replays"] >= sampled + 5, (sampled, found)
    print(found)
    for kind, c in found.items():
        assert c["violations"] == [] and c["unstable_inputs"] == 0, (kind, c)
        assert c["replays"] >= 5 and c["runs"] >= c["replays"], (kind, c)  # most of the ~8 steps
    print("GRAPH STEPS OK")
""")


@pytest.mark.parametrize("verifier", ["univer", "univer_wor"])
def test_full_graph_steps_on_the_fused_paths(tiny_pair, verifier):
    """``"cuda_graphs": "full"``'s replays on the CUDA code paths (Triton's
    interpreter; each graph emulated by rerunning its region under
    ``GraphDiscipline``): the draft levels (``DraftLevelGraphs``) and the sampled
    steps' verification (``VerifyGraphs``, the fused kernels; all-greedy steps'
    argmax matching too) show no host sync, no copy between devices, no tensor
    filled from host values (but constants, for the verification), the same
    storages read at every replay; greedy requests in a mixed batch, and an
    all-greedy batch, get the CPU paths' tokens."""
    from engine_job import ENV

    budget = str(FULL_GRAPH_STEP_BUDGET[verifier])
    out = run_interpreted(
        GRAPHS_SCRIPT,
        "GRAPH STEPS OK",
        *tiny_pair,
        verifier,
        budget,
        env={**ENV, "VLLM_UNIVER_OP_COUNTS": "1"},
        timeout=1500,
    )
    print(out[-800:])
