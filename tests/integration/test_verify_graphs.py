"""``VerifyGraphs``: a sampled step's verification (softmax of the scaled logits,
then the verifier) replayed from a graph, on the CUDA code path (the
fused kernels, in Triton's interpreter; each graph emulated by ``rerun_capture``).

Per verifier and tree: the region run under ``GraphDiscipline`` (every run after
the warm-up, as a CUDA graph captures it) shows no host sync, no copy between
devices, no tensor filled from host values but constants (literals and the
tree's sizes, fixed per graph), and reads the same storages at every replay;
and each replay gives exactly the eager ``verify`` of the same inputs with the
same random draws (the device generator at the same state),
the first step's too: the warm-up run before the capture leaves the inputs as
the replay finds them (a softmax in place of the scaled logits did not). With
top-k, top-p and / or min_p set (per request, one request with none) the region
runs them too, and equals the eager probabilities (``probs_from_scaled``).
Per-request trees (``TreeBatch``, other parents at every step): the same checks;
all-greedy steps' argmax matching (``verify_greedy``) too.
Then the bookkeeping: a buffer at another address gets its own graph, up to a
bound per size; past it, new addresses run eagerly and known ones still replay.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytest.importorskip("triton")

CHECK = r"""
import torch
from vllm_univer import verify
from vllm_univer.core.tree import TreeSpec
from vllm_univer.integration.draft_level_graphs import rerun_capture
from vllm_univer.integration.sampling.target_probs import probs_from_scaled
from vllm_univer.integration.verify_graphs import VerifyGraphs
from engine_job import checked_capture



B = 3
TOP_K, TOP_P = torch.tensor([5, 32, 3], dtype=torch.int32), torch.tensor([0.8, 1.0, 0.6])
MIN_P = torch.tensor([0.0, 0.3, 0.1])
# (univer_wor's kernels take vocabularies above 64 tokens; top-k 32 = the vocabulary: none)
CASES = [
    ("univer", "2x3", 32, None, None, None),
    ("traversal", "2x3", 32, None, None, None),
    ("univer_wor", "2x2", 80, None, None, None),
    ("token", "1x4", 32, None, None, None),
    ("univer", "2x3", 32, TOP_K, TOP_P, None),
    ("univer", "2x2", 32, TOP_K, None, None),
    ("univer_wor", "2x2", 80, None, TOP_P, None),
    ("univer", "2x2", 32, None, None, MIN_P),
    ("traversal", "2x2", 32, TOP_K, TOP_P, MIN_P),
]
for method, shape, V, top_k, top_p, min_p in CASES:
    options = (top_k, top_p, min_p)
    tree = TreeSpec.parse(shape)
    n1 = tree.num_nodes + 1
    checks = {}

    graphs = VerifyGraphs(method, checked_capture(checks, constant_fills=True), fused=True)
    scaled, q = torch.empty(B, n1, V), torch.empty(B, n1, V)  # the sampler's and the drafter's kept buffers
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        logits = torch.randn(B, n1, V, generator=g) * 2
        q.copy_(torch.softmax(torch.randn(B, n1, V, generator=g), -1))
        tokens = torch.randint(0, V, (B, n1), generator=g)
        tokens[2, 3:] = -1  # a tree cut short
        greedy = torch.tensor([False, step % 2 == 1, False])
        scaled.copy_(logits)
        torch.manual_seed(100 + step)
        got, got_p = graphs.verify(tree, tokens, scaled, q, greedy, *options)
        # The eager step on the same inputs and draws (the first step's replay follows
        # the warm-up and the captured run, which drew from the same generator).
        torch.manual_seed(100 + step)
        for _ in range(3 if step == 0 else 1):
            p = probs_from_scaled(logits.clone(), *options)
            if any(option is not None for option in options):  # the options cut something
                assert (p == 0).any() and not (torch.softmax(logits, -1) == 0).any()
            want = verify(method, tree, tokens, p, q, greedy=greedy, validate=False, fused=True)
        assert torch.equal(got.output_token_ids, want.output_token_ids), (method, step)
        assert torch.equal(got.end_node, want.end_node) and torch.equal(got.num_accepted, want.num_accepted)
        assert torch.equal(scaled, logits), (method, step)  # an input of every replay: left as it is
        assert torch.equal(got_p, p), (method, step)  # the probabilities verified against, for auto's estimates
    assert graphs.replays == 4 and len(graphs.graphs) == 1, method
    assert checks["runs"] == 1 + 4, (method, checks)  # the captured run, then every replay
    assert checks["violations"] == [] and checks["unstable_inputs"] == 0, (method, checks)
    print(method, shape, [option is not None for option in options], "ok")

# Per-request trees (tree "dynamic"): a TreeBatch on shared levels, other parents at
# every step; the parents copied in, the tables built inside the region.
from vllm_univer.core.tree_batch import LevelLayout, TreeBatch

layout, V = LevelLayout((1, 2, 3, 2), 2), 32
PARENTS = [
    [[-1, 0, 0, 1, 1, 2, 3, -1], [-1, 0, 0, 2, 2, -1, 3, 4], [-1, 0, -1, 1, 1, -1, 3, 3]],
    [[-1, 0, 0, 1, 2, 2, 5, 5], [-1, 0, 0, 1, 1, 2, 3, 4], [-1, 0, 0, 2, -1, -1, 3, -1]],
]
for method in ("univer", "target_only"):
    checks = {}

    graphs = VerifyGraphs(method, checked_capture(checks, constant_fills=True), fused=True)
    scaled, q = torch.empty(B, 8, V), torch.empty(B, 8, V)
    for step in range(4):
        g = torch.Generator().manual_seed(10 + step)
        trees = TreeBatch(torch.tensor(PARENTS[step % 2]), layout.level_sizes, layout.max_children)
        logits = torch.randn(B, 8, V, generator=g) * 2
        q.copy_(torch.softmax(torch.randn(B, 8, V, generator=g), -1))
        tokens = torch.randint(0, V, (B, 8), generator=g).masked_fill(trees.parent < 0, -1)
        tokens[:, 0] = 0
        greedy = torch.tensor([False, False, step == 2])
        scaled.copy_(logits)
        torch.manual_seed(200 + step)
        got, got_p = graphs.verify(trees, tokens, scaled, q, greedy, None, TOP_P, None)
        torch.manual_seed(200 + step)
        for _ in range(3 if step == 0 else 1):
            p = probs_from_scaled(logits.clone(), None, TOP_P)
            want = verify(method, trees, tokens, p, q, greedy=greedy, validate=False, fused=True)
        assert torch.equal(got_p, p), (method, step)
        assert torch.equal(got.output_token_ids, want.output_token_ids), (method, step)
        assert torch.equal(got.end_node, want.end_node) and torch.equal(got.num_accepted, want.num_accepted)
    assert graphs.replays == 4 and len(graphs.graphs) == 1, method
    assert checks["runs"] == 1 + 4, (method, checks)
    assert checks["violations"] == [] and checks["unstable_inputs"] == 0, (method, checks)
    print(method, "per-request trees ok")

# All-greedy steps: argmax matching replayed (tokens and argmax copied in), one shape
# and per-request trees.
from vllm_univer import verify_greedy

PER_REQUEST = [TreeBatch(torch.tensor(parents), layout.level_sizes, 2) for parents in PARENTS]
for trees_of_step in ([TreeSpec.parse("2x3")] * 2, PER_REQUEST):
    checks = {}
    graphs = VerifyGraphs("univer", checked_capture(checks, constant_fills=True), fused=True)
    n1 = trees_of_step[0].num_nodes + 1
    for step in range(4):
        trees = trees_of_step[step % 2]
        g = torch.Generator().manual_seed(30 + step)
        tokens = torch.randint(0, 4, (B, n1), generator=g)
        argmax = torch.randint(0, 4, (B, n1), generator=g)  # 4 tokens: many matches
        got = graphs.verify_greedy(trees, tokens, argmax)
        want = verify_greedy(trees, tokens, argmax)
        assert torch.equal(got.output_token_ids, want.output_token_ids), step
        assert torch.equal(got.end_node, want.end_node) and torch.equal(got.num_accepted, want.num_accepted)
    assert graphs.replays == 4 and len(graphs.graphs) == 1
    assert checks["runs"] == 1 + 4, checks
    assert checks["violations"] == [] and checks["unstable_inputs"] == 0, checks
    print("greedy", type(trees).__name__, "ok")

# Buffers at new addresses: a graph each, up to the bound; then eager, and known ones still replay.
tree = TreeSpec.parse("2x2")
graphs = VerifyGraphs("univer", rerun_capture, fused=True)
V = 32
tokens, greedy = torch.zeros(1, 7, dtype=torch.long), torch.tensor([False])
q = torch.softmax(torch.randn(1, 7, V), -1)
buffers = [torch.randn(1, 7, V) for _ in range(6)]
for moved, scaled in enumerate(buffers):
    result = graphs.verify(tree, tokens, scaled, q, greedy)
    assert (result is None) == (moved >= 4), moved
    assert len(graphs.graphs) == min(moved + 1, 4)
assert graphs.verify(tree, tokens, buffers[1], q, greedy) is not None and graphs.replays == 5
# Probabilities past what a kept buffer holds: eager (a new buffer every step), nothing captured.
from vllm_univer.integration.step_buffer import StepBuffer

graphs = VerifyGraphs("univer", rerun_capture, fused=True)
graphs.probs = StepBuffer(torch.device("cpu"), keep=True, max_kept_bytes=4 * 7 * V - 1)
assert graphs.verify(tree, tokens, buffers[0], q, greedy) is None and not graphs.graphs
print("VERIFY GRAPHS OK")
"""


def test_verification_replayed_from_graphs_equals_eager_in_interpreter():
    from triton_interpreter import run_interpreted

    print(run_interpreted(CHECK, "VERIFY GRAPHS OK", timeout=1200)[-1500:])
