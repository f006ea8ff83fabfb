"""Tree attention a full CUDA graph can capture (``PersistentTreeAttention``),
checked on CPU for what capture needs (issue 49, item 4): each layer's call
reads the same buffers in two steps with different trees, contexts, request
counts and valid rows; it issues no ATen op at all (no allocation, no sync, no
copy: the launch alone); the step's plan reaches the buffers by copies only;
and the rows are bit-identical to the eager launch of the same step. The
kernel runs under Triton's interpreter (a subprocess)."""

from __future__ import annotations

import textwrap

import pytest
import torch
from triton_interpreter import run_interpreted

pytest.importorskip("triton")

from vllm_univer.core.tree_batch import TreeBatch  # noqa: E402
from vllm_univer.integration.attention.persistent_tree_attention import (  # noqa: E402
    PersistentTreeAttention,
    TreePlanBuffers,
)
from vllm_univer.integration.attention.tree_attention_plan import TreeAttentionPlan  # noqa: E402

# Both scripts: the tree-attention launches of a block recorded (name, grid, arguments), not run.
RECORDER = textwrap.dedent("""
    import contextlib
    import vllm_univer.integration.attention.triton_paged_tree_attention as kernels

    @contextlib.contextmanager
    def recorded_launches():
        launches, names = [], ("_paged_tree_attention_kernel", "_merge_splits_kernel")
        real = {name: getattr(kernels, name) for name in names}

        class Recorder:
            def __init__(self, name):
                self.name = name
            def __getitem__(self, grid):
                return lambda **args: launches.append((self.name, grid, args))

        for name in names:
            setattr(kernels, name, Recorder(name))
        try:
            yield launches
        finally:
            for name in names:
                setattr(kernels, name, real[name])
""")

CHECK = RECORDER + textwrap.dedent("""
    import torch
    from vllm_univer.core.tree_batch import TreeBatch
    from vllm_univer.integration.attention.persistent_tree_attention import PersistentTreeAttention, TreePlanBuffers
    from vllm_univer.integration.attention.tree_attention_plan import TreeAttentionPlan
    from vllm_univer.integration.attention.triton_paged_tree_attention import paged_tree_attention_triton
    from vllm_univer.tools.graph_discipline import GraphDiscipline

    gen = torch.Generator().manual_seed(0)
    BLOCK, BLOCKS, MAX_LEN, N1, R = 16, 64, 128, 6, 4
    kv = torch.randn(BLOCKS, 2, BLOCK, 64, generator=gen)
    keys, values = kv.transpose(1, 2).split(32, dim=-1)  # vLLM's layout, viewed [blocks, block, Hkv, Dh]
    tokens = R * N1 + 5  # the captured forward's rows: tree rows and a few others
    query = torch.randn(tokens, 4, 32, generator=gen)
    output = torch.full_like(query, 7.0)
    table = torch.randperm(BLOCKS, generator=gen)[:48].view(6, 8).int()  # the forward's block table

    def plan(parent, reqs, context, valid):
        mask = TreeBatch(torch.tensor(parent), (1, 2, 3), 2).ancestor_mask
        n = len(reqs)
        return TreeAttentionPlan(
            query_rows=torch.randperm(tokens, generator=gen)[: n * N1].view(n, N1),
            row_valid=None if valid is None else torch.arange(N1).unsqueeze(0) < torch.tensor(valid).unsqueeze(1),
            request_index=torch.tensor(reqs), context_lens=torch.tensor(context), mask=mask,
            covers_all_rows=False, max_context_len=max(context))

    steps = [  # fewer requests after more: the padding must be rewritten
        plan([[-1, 0, 0, 1, 2, 2], [-1, 0, -1, 1, -1, -1], [-1, 0, 0, 1, 1, 2]], [1, 5, 2], [40, 7, 0], [6, 4, 6]),
        plan([[-1, 0, 0, 1, 1, 2], [-1, 0, 0, 2, 2, -1]], [3, 0], [5, 100], None),
    ]
    for splits in (1, 3):
        buffers = TreePlanBuffers(R, N1, N1, 8, MAX_LEN, "cpu")
        attention = PersistentTreeAttention(buffers, query, keys, values, output, scale=0.3, num_splits=splits)
        read = None
        for step in steps:
            with GraphDiscipline() as writing:
                buffers.write(step, table)
            assert writing.violations == [], writing.violations
            # The layer's call with its launches recorded, not run: the host code around
            # them issues no ATen op, and each launch has the grid and the memory of the
            # first step (what a captured graph replays).
            with recorded_launches() as launches, GraphDiscipline() as layer:
                attention(query, keys, values, output)
            assert sum(layer.ops.values()) == 0, layer.ops
            seen = [(name, grid, {k: v.data_ptr() if torch.is_tensor(v) else v for k, v in args.items()})
                    for name, grid, args in launches]
            assert len(seen) == (2 if splits > 1 else 1)
            assert read is None or seen == read, "a launch differs from the first step's"
            read = seen
            output.fill_(7.0)
            attention(query, keys, values, output)
            eager = torch.full_like(query, 7.0)
            paged_tree_attention_triton(query, keys, values, table[step.request_index], step.context_lens,
                                        step.query_rows, step.mask, eager, scale=0.3, row_valid=step.row_valid,
                                        max_context_len=MAX_LEN, num_splits=splits)
            assert torch.equal(output, eager), (output - eager).abs().max()
            written = (output != 7.0).any(-1).any(-1)
            valid = torch.ones_like(step.query_rows, dtype=torch.bool) if step.row_valid is None else step.row_valid
            assert written.sum() == valid.sum()  # padding requests and cut rows: nothing written
        owned = {t.data_ptr() for t in (buffers.query_rows, buffers.row_valid, buffers.block_table,
                                        buffers.context_lens, buffers.mask)}
        assert owned <= {t.data_ptr() for t in attention.launch_tensors()}
    print("OK")
""")


def test_persistent_tree_attention_is_capturable_and_exact():
    run_interpreted(CHECK, "OK")


def _buffers(**sizes):
    sizes = {"max_reqs": 4, "num_queries": 6, "num_tree_keys": 6, "max_blocks": 8, "max_model_len": 128, **sizes}
    return TreePlanBuffers(**sizes, device="cpu")


def _plan(reqs: int, queries: int = 6, context: int = 10):
    mask = TreeBatch(torch.tensor([[-1, 0, 0, 1, 1, 2]] * reqs), (1, 2, 3), 2).ancestor_mask[:, :queries, :queries]
    return TreeAttentionPlan(
        query_rows=torch.arange(reqs * queries).view(reqs, queries),
        row_valid=None,
        request_index=torch.arange(reqs),
        context_lens=torch.full((reqs,), context),
        mask=mask,
        covers_all_rows=True,
        max_context_len=context,
    )


@pytest.mark.parametrize(
    "plan, message",
    [
        (_plan(5), "does not fit the captured size"),
        (_plan(2, queries=4), "does not fit the captured size"),
        (_plan(2, context=125), "exceed max_model_len"),
    ],
)
def test_plans_that_do_not_fit_the_bucket_fail_clearly(plan, message):
    with pytest.raises(ValueError, match=message):
        _buffers().write(plan, torch.zeros(6, 8, dtype=torch.int32))


def test_sizes_that_cannot_hold_a_context_fail_clearly():
    query, cache = torch.zeros(30, 4, 32), torch.zeros(64, 16, 2, 32)
    with pytest.raises(ValueError, match="do not hold max_model_len"):
        PersistentTreeAttention(_buffers(max_blocks=4), query, cache, cache, query.clone())
    with pytest.raises(ValueError, match="must be >= 1"):
        _buffers(max_reqs=0)


# vLLM's full CUDA graph of a uniform batch, emulated on CPU: "capture" runs each
# layer's tree rows through ``forward_tree_rows`` with its launches recorded (the
# dummy forward: buffers cleared); each "replay" writes a real batch's plan into the
# captured size's buffers and reruns the recorded launches as they are (grid,
# pointers, scalars), with the real kernel, on the graph's static query and output
# holding new data. Every request of the batch is a plan row: trees (their own
# masks) and a prompt chunk of exactly N + 1 tokens (causal). The replayed rows
# equal the eager launch of the batch bit for bit, and the reference to 2e-5.
GRAPH_REPLAY = RECORDER + textwrap.dedent("""
    from types import SimpleNamespace
    import torch
    from vllm_univer.core.tree_batch import TreeBatch
    from vllm_univer.integration.attention.cuda_tree_attention import forward_tree_rows
    from vllm_univer.integration.attention.tree_attention import gather_paged, tree_attention
    from vllm_univer.integration.attention.tree_attention_plan import TreeAttentionPlan
    from vllm_univer.integration.attention.tree_graph_plans import TreeGraphPlans, uniform_batch_plan
    from vllm_univer.integration.attention.triton_paged_tree_attention import paged_tree_attention_triton

    gen = torch.Generator().manual_seed(1)
    N1, PADDED_REQS, MAX_LEN, HEADS, KV_HEADS, DH = 6, 4, 128, 4, 2, 32
    impl = SimpleNamespace(num_heads=HEADS, head_size=DH, scale=0.3)
    layers = [torch.randn(64, KV_HEADS, 16, 2 * DH, generator=gen) for _ in range(2)]  # vLLM's CUDA cache layout
    query = torch.zeros(PADDED_REQS * N1, HEADS * DH)  # the graph's static tensors
    output = torch.zeros_like(query)
    graphs = TreeGraphPlans({N1}, MAX_LEN)

    table = torch.randperm(64, generator=gen)[:48].view(6, 8).int()
    captured = graphs.for_forward(PADDED_REQS * N1, N1, None, table)  # the dummy forward of capture
    with recorded_launches() as launches:
        for kv in layers:
            meta = SimpleNamespace(block_table=table)
            forward_tree_rows(impl, None, query, None, None, kv, meta, output, captured)
    assert len(launches) == 2  # one per layer, one launch prepared for both

    def batch(parents, context):
        # Requests with a parent row are trees; None: a prompt chunk of N1 tokens.
        trees = [i for i, p in enumerate(parents) if p is not None]
        own = TreeBatch(torch.tensor([parents[i] for i in trees]), (1, 2, 3), 2).ancestor_mask
        tree_plan = TreeAttentionPlan(
            query_rows=torch.tensor(trees).unsqueeze(1) * N1 + torch.arange(N1), row_valid=None,
            request_index=torch.tensor(trees), context_lens=torch.tensor(context)[trees], mask=own,
            covers_all_rows=True, max_context_len=max(context))
        plan = uniform_batch_plan(tree_plan, torch.tensor(context), max(context), N1)
        expected_mask = torch.ones(len(parents), N1, N1, dtype=torch.bool).tril()
        expected_mask[trees] = own
        return plan, expected_mask

    steps = [
        batch([[-1, 0, 0, 1, 1, 2], None, [-1, 0, -1, 1, -1, -1], [-1, 0, 0, 2, 2, 1]], [30, 9, 0, 100]),
        batch([[-1, 0, 0, 1, 2, 2], None], [44, 17]),  # fewer requests: the padding must go quiet
    ]
    for plan, mask in steps:
        reqs = mask.shape[0]
        assert graphs.for_forward(PADDED_REQS * N1, N1, plan, table) is captured
        rows = torch.arange(reqs * N1).view(reqs, N1)
        for (name, grid, args), kv in zip(launches, layers):  # the replay, layer by layer (one static output here)
            query.copy_(torch.randn(query.shape, generator=gen))
            output.fill_(7.0)
            getattr(kernels, name)[grid](**args)
            keys, values = kv.transpose(1, 2)[..., :DH], kv.transpose(1, 2)[..., DH:]
            got = args["out_ptr"]
            eager = torch.full_like(got, 7.0)
            q = args["q_ptr"]
            paged_tree_attention_triton(q, keys, values, table[:reqs], plan.context_lens, rows, mask, eager,
                                        scale=0.3, max_context_len=MAX_LEN, num_splits=1)
            assert torch.equal(got, eager), (got - eager).abs().max()
            assert (got[reqs * N1:] == 7.0).all(), "the padding requests' rows were written"
            positions = plan.context_lens.unsqueeze(1) + torch.arange(N1)
            ref = tree_attention(q[rows].double(), gather_paged(keys, table[:reqs], positions).double(),
                                 gather_paged(values, table[:reqs], positions).double(), keys.double(),
                                 values.double(), table[:reqs], plan.context_lens, mask, scale=0.3)
            torch.testing.assert_close(got[rows].double(), ref, atol=2e-5, rtol=2e-5)
    print("OK")
""")


def test_full_graph_replay_of_a_uniform_batch_is_exact():
    run_interpreted(GRAPH_REPLAY, "OK")


def test_graph_plans_are_written_without_a_host_sync():
    """What runs before a replay (``uniform_batch_plan`` and the copies into the
    captured size's buffers) reads no device value on the host; each padded size
    keeps one plan across steps, and a dummy forward leaves no row valid."""
    from vllm_univer.integration.attention.tree_graph_plans import TreeGraphPlans, uniform_batch_plan
    from vllm_univer.tools.graph_discipline import GraphDiscipline

    graphs = TreeGraphPlans({6}, 128)
    table = torch.arange(48, dtype=torch.int32).view(6, 8)
    tree_plan = _plan(2)
    tree_plan.request_index = torch.tensor([0, 2])
    with GraphDiscipline() as host:
        plan = uniform_batch_plan(tree_plan, torch.tensor([10, 3, 10]), 10, 6)
        graph_plan = graphs.for_forward(24, 6, plan, table)
    assert not [v for v in host.violations if "host" in v or "between devices" in v], host.violations
    buffers = graph_plan.buffers
    assert buffers.row_valid[:3].all() and not buffers.row_valid[3:].any()
    assert torch.equal(buffers.mask[1].bool(), torch.ones(6, 6, dtype=torch.bool).tril())  # the prompt chunk
    assert torch.equal(buffers.mask[2].bool(), tree_plan.mask[1])
    assert torch.equal(buffers.query_rows[:3], torch.arange(18).view(3, 6))
    assert graphs.for_forward(24, 6, None, table) is graph_plan and not buffers.row_valid.any()
    assert graphs.for_forward(12, 6, None, table) is not graph_plan


def test_graph_plans_per_query_length():
    """``tree: auto``'s cuts under full graphs: one plan per (padded tokens, query
    tokens per request), each of its own length; a length without graphs fails
    clearly; a tree of fewer positions than the batch's length (drafted for a larger
    shape, not verified this step) keeps causal rows past its own."""
    from vllm_univer.integration.attention.tree_graph_plans import TreeGraphPlans, uniform_batch_plan

    graphs = TreeGraphPlans({3, 6}, 128)
    table = torch.arange(48, dtype=torch.int32).view(6, 8)
    whole = graphs.for_forward(12, 6, uniform_batch_plan(_plan(2), torch.tensor([10, 10]), 10, 6), table)
    cut = graphs.for_forward(12, 3, uniform_batch_plan(_plan(4, queries=3), torch.tensor([10] * 4), 10, 3), table)
    assert cut is not whole and cut.buffers.mask.shape == (4, 3, 3) and whole.buffers.mask.shape == (2, 6, 6)
    assert torch.equal(cut.buffers.mask[3].bool(), _plan(1, queries=3).mask[0])
    assert graphs.for_forward(12, 3, None, table) is cut
    with pytest.raises(ValueError, match="no full-graph tree plan for 4 tokens per request"):
        graphs.for_forward(12, 4, None, table)

    smaller = _plan(1, queries=4)
    smaller.request_index = torch.tensor([1])
    mask = uniform_batch_plan(smaller, torch.tensor([5, 7]), 7, 6).mask
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    assert torch.equal(mask[0], causal)
    expected = causal.clone()
    expected[:4, :4] = smaller.mask[0]
    assert torch.equal(mask[1], expected)
