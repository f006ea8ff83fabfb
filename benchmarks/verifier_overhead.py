"""Time ``vllm_univer.verify`` against vLLM 0.32's own rejection sampler, side by side.

For each batch size B, tree and vocabulary V: our verifiers on a [B, N+1, V]
batch of random float32 probability rows, and vLLM's ``rejection_sample`` (the
core of ``RejectionSampler.forward``) verifying a chain of N draft tokens per
request (N target rows per request, the bonus token sampled outside), at
temperature 1. The ratio compares time per probability row.
Peak extra memory (resident-set high-water mark during the call, over the
input tensors' bytes) is measured
for ``univer`` in a fresh subprocess per configuration.

    python -m benchmarks.verifier_overhead            # full grid
    python -m benchmarks.verifier_overhead --quick    # V = 32000, B in {1, 16}
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from vllm_univer import TreeSpec, draft_children, scheme_for, verify

RESULTS = Path(__file__).parent / "results"


def make_inputs(method: str, tree: TreeSpec, batch: int, vocab: int, seed: int = 0):
    """Random but well-formed inputs: trees drafted with the method's scheme from q."""
    gen = torch.Generator().manual_seed(seed)
    n1 = tree.num_nodes + 1
    q = torch.randn(batch, n1, vocab, generator=gen).mul_(3).softmax(-1)
    p = 0.7 * q + 0.3 * torch.randn(batch, n1, vocab, generator=gen).mul_(3).softmax(-1)
    tokens = torch.full((batch, n1), -1, dtype=torch.long)
    scheme = "chain" if tree.is_chain and method in ("token", "block") else scheme_for(method)
    for v in range(n1):
        kids = [c for c in tree.children[v].tolist() if c >= 0]
        if kids:
            tokens[:, kids] = draft_children(scheme, q[:, v], len(kids), generator=gen)
    return tokens, p, q


def time_call(fn, repeat: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def vllm_chain_sampler(batch: int, num_draft: int, vocab: int):
    """A closure running vLLM's rejection_sample on a k = num_draft chain per request."""
    from vllm.platforms import current_platform

    if hasattr(current_platform, "register_triton_kernel_overrides"):
        current_platform.register_triton_kernel_overrides()
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.rejection_sampler import rejection_sample

    gen = torch.Generator().manual_seed(1)
    rows = batch * num_draft
    draft_probs = torch.randn(rows, vocab, generator=gen).mul_(3).softmax(-1)
    target_logits = torch.randn(rows, vocab, generator=gen).mul_(3)
    draft_ids = torch.multinomial(draft_probs, 1, generator=gen).flatten().to(torch.int32)
    num_draft_tokens = [num_draft] * batch
    cu = torch.arange(1, batch + 1, dtype=torch.int32) * num_draft
    bonus = torch.zeros(batch, 1, dtype=torch.int32)
    meta = SamplingMetadata(
        temperature=torch.ones(batch),
        all_greedy=False,
        all_random=True,
        top_p=None,
        top_k=None,
        generators={},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch),
        presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.ones(batch),
        output_token_ids=[[] for _ in range(batch)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )

    def run():
        return rejection_sample(draft_ids, num_draft_tokens, num_draft, cu, draft_probs, target_logits, bonus, meta)

    return run


def peak_extra_memory(method: str, tree: str, batch: int, vocab: int) -> tuple[float, float]:
    """(input bytes, peak extra bytes) of one verify call, measured in a fresh process."""
    code = f"""
import torch
from benchmarks.verifier_overhead import make_inputs
from vllm_univer import TreeSpec, verify
tree = TreeSpec.parse({tree!r})
tokens, p, q = make_inputs({method!r}, tree, {batch}, {vocab})
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
verify({method!r}, tree, tokens[:1], p[:1], q[:1], validate=False)
open("/proc/self/clear_refs", "w").write("5")  # reset the RSS high-water mark (Linux)
before = status("VmRSS:")
verify({method!r}, tree, tokens, p, q, validate=False)
print((p.numel() + q.numel()) * p.element_size(), status("VmHWM:") - before)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=Path(__file__).parents[1]
    )
    inputs, extra = out.stdout.split()
    return float(inputs), float(extra)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="V = 32000 and B in {1, 16} only")
    ap.add_argument("--methods", default="univer,traversal,rrsw,greedy")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-memory", action="store_true")
    args = ap.parse_args()

    torch.set_grad_enabled(False)
    batches = [1, 16] if args.quick else [1, 16, 64]
    vocabs = [32000] if args.quick else [32000, 151936]
    trees = ["1x5", "2x5", "3x3"]
    methods = args.methods.split(",")

    rows = []
    header = (
        ["V", "B", "tree", "rows/req", "vLLM chain ms"]
        + [f"{m} ms" for m in methods]
        + [f"{m}/vLLM per row" for m in methods]
        + (["univer peak extra / inputs"] if not args.no_memory else [])
    )
    print("| " + " | ".join(header) + " |", flush=True)
    print("|" + "---|" * len(header), flush=True)
    for vocab in vocabs:
        for batch in batches:
            for tree_name in trees:
                tree = TreeSpec.parse(tree_name)
                n = tree.num_nodes
                t_vllm = time_call(vllm_chain_sampler(batch, n, vocab), args.repeat)
                times = {}
                for method in methods:
                    if method in ("token", "block") and not tree.is_chain:
                        times[method] = float("nan")
                        continue
                    tokens, p, q = make_inputs(method, tree, batch, vocab)
                    gen = torch.Generator().manual_seed(0)
                    times[method] = time_call(
                        lambda: verify(method, tree, tokens, p, q, generator=gen, validate=False), args.repeat
                    )
                    del tokens, p, q
                per_row_vllm = t_vllm / (batch * n)
                ratios = {m: (times[m] / (batch * (n + 1))) / per_row_vllm for m in methods}
                row = (
                    [vocab, batch, tree_name, n + 1, round(t_vllm * 1e3, 2)]
                    + [round(times[m] * 1e3, 2) for m in methods]
                    + [round(ratios[m], 2) for m in methods]
                )
                if not args.no_memory:
                    inputs, extra = peak_extra_memory("univer", tree_name, batch, vocab)
                    row.append(round(extra / inputs, 2))
                rows.append(row)
                print("| " + " | ".join(str(x) for x in row) + " |", flush=True)

    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    machine = (
        f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}"
    )
    try:
        import vllm

        machine += f", vllm {vllm.__version__}"
    except Exception:  # noqa: BLE001 - the header is informative only
        pass
    out = RESULTS / f"verifier_overhead{'_quick' if args.quick else ''}.md"
    lines = [
        f"# verify() vs vLLM RejectionSampler ({stamp})",
        "",
        f"Command: `python -m benchmarks.verifier_overhead {' '.join(sys.argv[1:])}`",
        "",
        f"Machine: {machine}",
        "",
        "Times are the best of repeated calls (float32, temperature 1, no input validation).",
        "`X/vLLM per row` = (our time / (B*(N+1) rows)) / (vLLM time / (B*N rows)).",
        "Peak extra memory: resident-set high-water mark of one `univer` call over the input tensors.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *["| " + " | ".join(str(x) for x in r) + " |" for r in rows],
    ]
    out.write_text("\n".join(lines) + "\n")
    (out.with_suffix(".json")).write_text(json.dumps({"header": header, "rows": rows, "machine": machine}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
