"""Tree attention per layer on vLLM's CPU backend, side by side with vLLM's own kernel.

For each case (requests x context x tree rows, Qwen2.5-1.5B's heads: 12 query /
2 key-value heads of 128) one layer's cache is written by vLLM's
``cpu_attn_reshape_and_cache`` in the layout this machine's vLLM uses for the dtype
(``amx`` for bfloat16 on CPUs with AMX tiles, else ``vec``), and the script times:

* ``backend``: the tree rows as the patched CPU backend computes them
  (``cpu_tree_attention.forward_tree_rows``: whole blocks straight into token order,
  one SDPA with grouped heads folded; the plan's workspace and key mask shared by
  the layers of a forward, as in the engine);
* ``reference``: the generic ``kernels.tree_attention`` (blocks read through the
  ``cpu_kv_views`` of the same cache, context and tree keys concatenated);
* ``vLLM causal``: vLLM's own ``cpu_attention_with_kv_cache`` on the same number of
  query rows per request as a causal chain (what a plain engine's kernel costs for
  those rows; not a tree).

Times are the median of 30 calls after a warm-up, in one process, so the columns
compare side by side; the machine's own drift moves all three.

    python -m benchmarks.cpu_tree_attention
"""

from __future__ import annotations

import math
import platform
import statistics
import sys
import time
import types
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"
HQ, HKV, DH, BLOCK = 12, 2, 128, 128
CASES = [  # (requests, context tokens, tree)
    (8, 600, "2x1"),
    (8, 200, "2x1"),
    (8, 600, "2x3"),
    (8, 600, "2x5"),
    (1, 200, "2x3"),
    (1, 200, "2x5"),
]


def _median_ms(fn, repeat: int = 30) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def run_case(batch: int, context: int, shape: str, dtype: torch.dtype) -> dict:
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from vllm_univer import TreeSpec
    from vllm_univer.integration.attention import tree_attention
    from vllm_univer.integration.attention.cpu_tree_attention import forward_tree_rows
    from vllm_univer.integration.attention.kv_cache_views import cpu_kv_views
    from vllm_univer.integration.attention.tree_attention_plan import TreeAttentionPlan

    isa = _get_attn_isa(dtype, BLOCK, DH)
    tree = TreeSpec.parse(shape)
    rows = tree.num_nodes + 1
    gen = torch.Generator().manual_seed(0)
    per_request = math.ceil((context + rows) / BLOCK)
    num_blocks = batch * per_request + 512  # a real cache holds other requests' blocks too
    kv = torch.zeros(num_blocks, HKV, BLOCK, 2 * DH, dtype=dtype)
    table = torch.randperm(num_blocks, generator=gen)[: batch * per_request].view(batch, per_request).int()
    pos = torch.arange(context + rows)
    key_cache, value_cache = kv.view(num_blocks, HKV, 2 * BLOCK, DH).chunk(2, dim=2)
    for b in range(batch):
        slots = table[b, pos // BLOCK].long() * BLOCK + pos % BLOCK
        k, v = (torch.randn(len(pos), HKV, DH, generator=gen).to(dtype) for _ in range(2))
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0)
    query = torch.randn(batch * rows, HQ, DH, generator=gen).to(dtype)
    output = torch.empty(batch * rows, HQ * DH, dtype=dtype)
    context_lens = torch.full((batch,), context)
    plan = TreeAttentionPlan(
        query_rows=torch.arange(batch * rows).view(batch, rows),
        row_valid=None,
        request_index=torch.arange(batch),
        context_lens=context_lens,
        mask=tree.ancestor_mask,
        covers_all_rows=True,
        max_context_len=context,
    )
    impl = types.SimpleNamespace(num_heads=HQ, head_size=DH, scale=DH**-0.5)
    layer = types.SimpleNamespace(isa=isa)
    metadata = types.SimpleNamespace(block_table=table)
    backend = _median_ms(lambda: forward_tree_rows(impl, layer, query, None, None, kv, metadata, output, plan))

    keys, values = cpu_kv_views(kv, isa)
    tree_pos = context + torch.arange(rows)
    blocks = table.long().gather(1, (tree_pos // BLOCK).expand(batch, -1))
    tree_k, tree_v = keys[blocks, tree_pos % BLOCK], values[blocks, tree_pos % BLOCK]
    q = query.view(batch, rows, HQ, DH)
    reference = _median_ms(
        lambda: tree_attention(
            q, tree_k, tree_v, keys, values, table, context_lens, tree.ancestor_mask, max_context_len=context
        )
    )

    seq_lens = torch.full((batch,), context + rows, dtype=torch.int32)
    query_start = torch.arange(0, (batch + 1) * rows, rows, dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=batch,
        num_heads=HQ,
        num_kv_heads=HKV,
        head_dim=DH,
        seq_lens=seq_lens,
        dtype=dtype,
        query_start_loc=query_start,
        causal=True,
        sliding_window_size=-1,
        isa=isa,
        enable_kv_split=False,
    )
    causal_out = torch.empty(batch * rows, HQ, DH, dtype=dtype)
    vllm_causal = _median_ms(
        lambda: ops.cpu_attention_with_kv_cache(
            query=query,
            key_cache=key_cache,
            value_cache=value_cache,
            output=causal_out,
            query_start_loc=query_start,
            seq_lens=seq_lens,
            scale=DH**-0.5,
            causal=True,
            alibi_slopes=None,
            sliding_window=-1,
            block_table=table,
            softcap=0.0,
            scheduler_metadata=meta,
            s_aux=None,
        )
    )
    return {
        "batch": batch,
        "context": context,
        "tree": shape,
        "rows": rows,
        "isa": isa,
        "backend_ms": backend,
        "reference_ms": reference,
        "vllm_causal_ms": vllm_causal,
    }


def main() -> None:
    from vllm_univer.tools.host_cpu import host_cpu

    dtype = getattr(torch, host_cpu().serving_dtype()[0])
    results = [run_case(b, c, s, dtype) for b, c, s in CASES]
    lines = [
        "# Tree attention per layer on vLLM's CPU backend",
        "",
        f"Command: `python {' '.join(sys.argv)}`. Machine: {host_cpu().label}, {platform.platform()}, "
        f"{torch.get_num_threads()} threads; {dtype}, {HQ} query / {HKV} key-value heads of {DH}, blocks of {BLOCK}. "
        "Median of 30 calls, one process.",
        "",
        "| requests | context | tree (rows per request) | cache layout | backend (ms) | reference (ms) | "
        "vLLM causal, same rows (ms) | backend / vLLM |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['batch']} | {r['context']} | {r['tree']} ({r['rows']}) | {r['isa']} | {r['backend_ms']:.3f} | "
            f"{r['reference_ms']:.3f} | {r['vllm_causal_ms']:.3f} | {r['backend_ms'] / r['vllm_causal_ms']:.1f}x |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cpu_tree_attention.md").write_text(text)


if __name__ == "__main__":
    main()
