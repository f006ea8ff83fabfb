"""Host time per attention layer: the package's tree attention against vLLM's own
TRITON_ATTN forward on the same query rows and contexts, side by side in one run.

Under vLLM's piecewise CUDA graphs attention runs outside the graphs, called from
Python once per layer: a draft model's forward at small batch is then bound by
this host time, not by the GPU. Both paths are called as the engine calls them
(the backend's patched ``forward``; ours with a ``TreeAttentionPlan`` whose rows
are the whole forward, vLLM's causal), a fresh plan per forward (what the package
prepares once per forward is counted, shared by the layers). On a CPU, Triton's
own launch (``JITFunction.run``) is replaced by a no-op for both, so what is timed
is the Python up to it; on CUDA the launches are real (host time per layer, the
device synchronised between forwards only).

    python -m benchmarks.attention_host_overhead           # writes results/attention_host_overhead.md
"""

from __future__ import annotations

import argparse
import sys
import time
import types
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
# (name, Hq, Hkv, Dh, layers, tree, level): a draft level forward and a target verification forward.
CASES = [
    ("0.5B draft, 2x3 level 2", 14, 2, 64, 24, "2x3", 2),
    ("7B target, 2x3 whole tree", 28, 4, 128, 28, "2x3", None),
]
BLOCK = 16


def use_real_triton_in_vllm() -> None:
    """vLLM's CPU build hides Triton (no CPU driver): hand it the real module before
    its attention modules import, as on a GPU."""
    import triton
    import triton.language as tl
    import triton.language.extra.libdevice as tldevice
    import vllm.triton_utils as triton_utils

    triton_utils.triton, triton_utils.tl, triton_utils.tldevice = triton, tl, tldevice


def stub_triton_launches() -> None:
    from triton.runtime.jit import JITFunction

    JITFunction.run = lambda self, *args, **kwargs: None


def case_inputs(hq, hkv, dh, tree_spec, level, batch, context, device, dtype):
    from vllm_univer import TreeSpec
    from vllm_univer.integration.tree_drafter import _Shape

    tree = TreeSpec.parse(tree_spec)
    # A draft level: the mask the drafter hands that level's forward.
    mask = tree.ancestor_mask if level is None else _Shape(tree, device).level_masks[level]
    t = mask.shape[0]
    blocks = -(-(context + mask.shape[1]) // BLOCK)
    table = torch.arange(batch * blocks, dtype=torch.int32, device=device).view(batch, blocks)
    kv_cache = torch.zeros(batch * blocks, hkv, BLOCK, 2 * dh, device=device, dtype=dtype)
    query = torch.randn(batch * t, hq, dh, device=device).to(dtype)
    return mask.to(device), t, table, kv_cache, query


def ours(impl, layers, mask, t, table, kv_cache, query, context):
    from vllm_univer.integration.attention.tree_attention_plan import TreeAttentionPlan

    batch = table.shape[0]
    device = query.device
    out = torch.empty_like(query)

    def forward():
        plan = TreeAttentionPlan(
            query_rows=torch.arange(batch * t, device=device).view(batch, t),
            row_valid=None,
            request_index=torch.arange(batch, device=device),
            context_lens=torch.full((batch,), context, device=device),
            mask=mask,
            covers_all_rows=True,
            max_context_len=context,
        )
        metadata = types.SimpleNamespace(block_table=table, tree_plan=plan)
        for _ in range(layers):
            impl.forward(None, query, None, None, kv_cache, metadata, out)

    return forward


def vllms(impl, layers, t, table, kv_cache, query, context):
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadata

    batch = table.shape[0]
    device = query.device
    out = torch.empty_like(query)
    layer = types.SimpleNamespace(_q_scale=torch.ones(1, device=device), _k_scale=torch.ones(1, device=device))
    layer._v_scale = layer._k_scale
    starts = torch.arange(0, batch * t + 1, t, dtype=torch.int32, device=device)

    def forward():
        metadata = TritonAttentionMetadata(
            num_actual_tokens=batch * t,
            max_query_len=t,
            query_start_loc=starts,
            max_seq_len=context + t,
            seq_lens=torch.full((batch,), context + t, dtype=torch.int32, device=device),
            block_table=table,
            slot_mapping=torch.zeros(batch * t, dtype=torch.long, device=device),
            seq_threshold_3D=0,
            num_par_softmax_segments=0,
            softmax_segm_output=None,
            softmax_segm_max=None,
            softmax_segm_expsum=None,
            causal=True,
        )
        for _ in range(layers):
            impl.forward(layer, query, None, None, kv_cache, metadata, out)

    return forward


def host_us_per_layer(forward, layers: int, reps: int, sync) -> float:
    forward()
    sync()
    spent = []
    for _ in range(reps):
        start = time.perf_counter()
        forward()
        spent.append(time.perf_counter() - start)
        sync()  # the launch queue drained between forwards: host time only
    spent.sort()
    return 1e6 * spent[len(spent) // 2] / layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument(
        "--interpreted-launches",
        action="store_true",
        help="on a CPU, run the kernels (with TRITON_INTERPRET=1) instead of stubbing their launch: "
        "checks the GPU run's calls, times nothing useful",
    )
    args = ap.parse_args()

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    if not on_gpu:
        use_real_triton_in_vllm()
        if not args.interpreted_launches:
            stub_triton_launches()
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    from vllm_univer.integration import patches

    patches.patch_attention_forwards()
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    launches = "kernels in Triton's interpreter" if args.interpreted_launches else "launches stubbed"
    machine = torch.cuda.get_device_name() if on_gpu else f"CPU ({torch.get_num_threads()} threads), {launches}"
    lines = [
        "# Host time per attention layer: tree attention against vLLM's TRITON_ATTN forward",
        "",
        f"Command: `python -m benchmarks.attention_host_overhead {' '.join(sys.argv[1:])}`. Machine: {machine}. "
        f"Context {args.context} tokens per request, median of {args.reps} forwards. Ours: the patched backend "
        "`forward` with a tree plan covering every row (vLLM's kernel skipped), a fresh plan per forward; "
        "vLLM's: `TritonAttentionImpl.forward`, causal over the same rows and keys.",
        "",
        "| case | batch | query rows | ours us/layer | vLLM's us/layer | ours / vLLM's |",
        "|---|---|---|---|---|---|",
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = out / ("attention_host_overhead" + ("_gpu" if on_gpu else "") + ".md")
    for name, hq, hkv, dh, layers, tree, level in CASES:
        impl = TritonAttentionImpl(hq, dh, dh**-0.5, hkv, None, None, "auto")
        for batch in args.batches:
            mask, t, table, kv_cache, query = case_inputs(hq, hkv, dh, tree, level, batch, args.context, device, dtype)
            a = host_us_per_layer(
                ours(impl, layers, mask, t, table, kv_cache, query, args.context), layers, args.reps, sync
            )
            b = host_us_per_layer(vllms(impl, layers, t, table, kv_cache, query, args.context), layers, args.reps, sync)
            lines.append(f"| {name} | {batch} | {batch * t} | {a:.1f} | {b:.1f} | {a / b:.2f}x |")
            print(lines[-1], flush=True)
            result.write_text("\n".join(lines) + "\n")  # row by row: a run cut short keeps its rows
    print("\n".join(lines))


if __name__ == "__main__":
    main()
