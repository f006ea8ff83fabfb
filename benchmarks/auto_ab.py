"""``tree: auto`` against fixed cuts of its own tree, alternating in one engine.

Between engines (``engine.py``: one process per row, one after the other) this
machine's speed drifts by as much as the effects ``auto`` is judged on. Here one
engine with ``tree: auto`` (max_tree 2x5) runs the same batch in rounds, each
round once per arm, so every arm sees the same machine within a minute:

* ``auto``: the sizer chooses, as in serving;
* ``plain``: every step cut to depth 0 (no speculation, in this engine);
* ``dN``: every request drafts max_tree cut to depth N (``d3`` is the tree 2x3);
* ``cN``: the chain of first children (width cut 1) cut to depth N;
* ``mA.B..``: max_tree, the batch's requests cut to depths A, B, .. in turn
  (``m5.1.1.1``: every fourth request drafts the whole 2x5, the others depth 1).

Forced arms go through ``TreeSizer.set_schedule`` (the choice is overridden, its
measurements still run: ``auto`` keeps learning from them, as it would from its
own exploration). Prints tokens/s per arm and round, the paired ratios of each
arm to ``auto`` (same round), and appends the table to
``benchmarks/results/auto_ab.md``.

    python -m benchmarks.auto_ab --batch 8 --temperature 1 --arms auto plain d1
    python -m benchmarks.auto_ab --batch 1 --temperature 0 --new-tokens 64 --arms auto d3 plain
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.engine import ENV
from vllm_univer.tools.serving_defaults import serving_dtype

HERE = Path(__file__).resolve().parent


def schedule(arm: str) -> tuple[str | None, str | None]:
    """(depth cycle, width cycle) of ``TreeSizer.set_schedule`` for an arm."""
    if arm == "auto":
        return None, None
    if arm == "plain":
        return "0", None
    if arm[0] in "dc" and arm[1:].isdigit():
        return arm[1:], "2" if arm[0] == "d" else "1"
    if arm[0] == "m" and all(x.isdigit() for x in arm[1:].split(".")):
        return arm[1:].replace(".", ","), "2"
    raise SystemExit(
        f"unknown arm {arm!r}: auto, plain, dN (2x5 cut to depth N), cN (chain 1x5 cut to N) "
        "or mA.B.. (2x5, the batch's requests cut to A, B, .. in turn)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--dataset", default="mtbench", choices=["mtbench", "humaneval"])
    ap.add_argument("--arms", nargs="+", default=["auto", "plain", "d1"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--verifier", default="univer")
    args = ap.parse_args()
    for arm in args.arms:
        schedule(arm)
    os.environ.update(ENV)

    from vllm import LLM, SamplingParams

    from vllm_univer.tools.real_models import DEFAULT_DRAFT, DEFAULT_TARGET, model_dir, prompts

    llm = LLM(
        model=str(model_dir(DEFAULT_TARGET)),
        speculative_config={
            "method": "univer",
            "tree": "auto",
            "verifier": args.verifier,
            "model": str(model_dir(DEFAULT_DRAFT)),
        },
        dtype=serving_dtype()[0],
        enforce_eager=True,
        max_model_len=2048,
        max_num_seqs=max(args.batch, 8),
        seed=0,
    )
    tokenizer = llm.get_tokenizer()
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p["turns"][0]}], tokenize=False, add_generation_prompt=True
        )
        for p in prompts(args.dataset, limit=args.batch)
    ]

    def set_schedule(worker, depths, widths):
        worker.model_runner.tree_speculation.sizer.set_schedule(depths, widths)

    def depth_counts(worker):
        return dict(worker.model_runner.tree_speculation.sizer.requests_at_depth)

    params = SamplingParams(temperature=args.temperature, max_tokens=args.new_tokens, ignore_eos=True)
    llm.generate(texts, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # warm-up at this batch
    speed = {arm: [] for arm in args.arms}
    auto_depths: dict[int, int] = {}
    for r in range(args.rounds):
        for arm in args.arms:
            llm.collective_rpc(set_schedule, args=schedule(arm))
            before = llm.collective_rpc(depth_counts)[0]
            start = time.perf_counter()
            outputs = llm.generate(texts, params, use_tqdm=False)
            wall = time.perf_counter() - start
            speed[arm].append(sum(len(o.outputs[0].token_ids) for o in outputs) / wall)
            if arm == "auto":
                for d, n in llm.collective_rpc(depth_counts)[0].items():
                    auto_depths[d] = auto_depths.get(d, 0) + n - before.get(d, 0)
            print(f"round {r} {arm}: {speed[arm][-1]:.2f} tok/s", flush=True)
    llm.collective_rpc(set_schedule, args=(None, None))

    from benchmarks.engine import device_label

    command = "python -m benchmarks.auto_ab " + " ".join(sys.argv[1:])
    total = max(sum(auto_depths.values()), 1)
    lines = [
        "",
        f"## batch {args.batch}, T = {args.temperature:g}, {args.new_tokens} tokens, {args.dataset}, "
        f"verifier {args.verifier}",
        "",
        f"Command: `{command}`. Machine: {device_label()} ({platform.node() or 'host'}); "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. `auto` drafted depth cuts "
        + " / ".join(f"{d}: {100 * n / total:.0f}%" for d, n in sorted(auto_depths.items()))
        + " of its request-steps.",
        "",
        "| arm | tok/s per round | mean | vs auto, paired (mean, min .. max) |",
        "|---|---|---|---|",
    ]
    for arm, values in speed.items():
        paired = np.array(values) / np.array(speed.get("auto", values))
        lines.append(
            f"| {arm} | {' / '.join(f'{v:.2f}' for v in values)} | {np.mean(values):.2f} | "
            f"{paired.mean():.2f}x ({paired.min():.2f} .. {paired.max():.2f}) |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    out = HERE / "results" / "auto_ab.md"
    header = (
        "# tree auto against fixed cuts of its tree, alternating in one engine\n\n"
        "Each section: one engine, `tree: auto` (max_tree 2x5), Qwen2.5-Coder 1.5B / 0.5B; every round runs "
        "each arm once on the same prompts (`benchmarks/auto_ab.py`: arms, method).\n"
    )
    out.write_text((out.read_text() if out.exists() else header) + text)


if __name__ == "__main__":
    main()
