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
from vllm_univer.integration.attention.persistent_tree_attention import PersistentTreeAttention  # noqa: E402
from vllm_univer.integration.attention.tree_attention_plan import TreeAttentionPlan  # noqa: E402

CHECK = textwrap.dedent("""
    import torch
    from vllm_univer.core.tree_batch import TreeBatch
    from vllm_univer.integration.attention.persistent_tree_attention import PersistentTreeAttention
    from vllm_univer.integration.attention.tree_attention_plan import TreeAttentionPlan
    from vllm_univer.integration.attention.triton_paged_tree_attention import paged_tree_attention_triton
    from vllm_univer.tools.graph_discipline import GraphDiscipline

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
        attention = PersistentTreeAttention(query, keys, values, output, max_reqs=R, num_queries=N1,
                                            num_tree_keys=N1, max_blocks=8, max_model_len=MAX_LEN, scale=0.3,
                                            num_splits=splits)
        read = None
        for step in steps:
            with GraphDiscipline() as writing:
                attention.write(step, table)
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
        buffers = {t.data_ptr() for t in (attention.query_rows, attention.row_valid, attention.block_table,
                                           attention.context_lens, attention.mask)}
        assert buffers <= {t.data_ptr() for t in attention.launch_tensors()}
    print("OK")
""")


def test_persistent_tree_attention_is_capturable_and_exact():
    run_interpreted(CHECK, "OK")


def _attention(**sizes):
    query = torch.zeros(30, 4, 32)
    cache = torch.zeros(64, 16, 2, 32)
    sizes = {"max_reqs": 4, "num_queries": 6, "num_tree_keys": 6, "max_blocks": 8, "max_model_len": 128, **sizes}
    return PersistentTreeAttention(query, cache, cache, query.clone(), **sizes)


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
        (_plan(5), "does not fit the captured bucket"),
        (_plan(2, queries=4), "does not fit the captured bucket"),
        (_plan(2, context=125), "exceed max_model_len"),
    ],
)
def test_plans_that_do_not_fit_the_bucket_fail_clearly(plan, message):
    with pytest.raises(ValueError, match=message):
        _attention().write(plan, torch.zeros(6, 8, dtype=torch.int32))


def test_buckets_that_cannot_hold_a_context_fail_clearly():
    with pytest.raises(ValueError, match="do not hold max_model_len"):
        _attention(max_blocks=4)
    with pytest.raises(ValueError, match="must be >= 1"):
        _attention(max_reqs=0)
