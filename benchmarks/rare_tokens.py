"""Issue 61's check through vLLM on the real pair: is every emitted token as likely
as plain decoding would make it, where the draft is nearly sure (low temperature)?

Each engine (no speculation; tree speculation 2x5 with univer, univer_wor, greedy,
traversal) serves the same HumanEval prompts at T = 0.3 and T = 0.1 with
``logprobs_mode="processed_logprobs"``: every emitted token's log-probability under
the law it was sampled from (after the temperature). Lossless speculation emits
tokens distributed as plain decoding's, so the rate of rare tokens (processed
p < 1e-4) and the distribution of the emitted tokens' logprobs must match plain
decoding's: the rate within 2 standard errors, and a two-sample Kolmogorov-Smirnov
test on the logprobs. (Before the fix, univer 2x5 emitted 113 of 768 tokens with a
raw target probability below 1e-3 at T = 0.3, plain decoding none.)

    python -m benchmarks.rare_tokens                    # 8 prompts x 96 tokens, seeds 0 and 1
Results: ``benchmarks/results/rare_tokens.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from vllm_univer.tools.json_job import print_result, run_json_job

RESULTS = Path(__file__).resolve().parent / "results"
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
CONFIGS = {
    "plain": None,
    **{v: {"method": "univer", "tree": "2x5", "verifier": v} for v in ("univer", "univer_wor", "greedy", "traversal")},
}
RARE = math.log(1e-4)


def one_engine(job: dict) -> dict:
    """In its own process: one engine, every temperature and seed; per temperature the
    emitted tokens' processed logprobs."""
    from vllm import LLM, SamplingParams

    kwargs = {
        "model": job["target"],
        "dtype": job["dtype"],
        "max_model_len": 2048,
        "max_num_seqs": 8,
        "seed": 0,
        "logprobs_mode": "processed_logprobs",
        "enable_prefix_caching": False,
    }
    if job["spec"] is not None:
        kwargs["speculative_config"] = {**job["spec"], "model": job["draft"]}
    llm = LLM(**kwargs)
    out = {}
    for temperature in job["temperatures"]:
        values = []
        for seed in job["seeds"]:
            params = [
                SamplingParams(
                    temperature=temperature, max_tokens=job["tokens"], ignore_eos=True, logprobs=0, seed=seed * 1000 + i
                )
                for i in range(len(job["prompts"]))
            ]
            for result in llm.generate(job["prompts"], params, use_tqdm=False):
                done = result.outputs[0]
                values += [step[token].logprob for token, step in zip(done.token_ids, done.logprobs)]
        out[str(temperature)] = values
    return out


def ks_p_value(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample Kolmogorov-Smirnov p-value (SciPy's, exact where it can be)."""
    from scipy.stats import ks_2samp

    return float(ks_2samp(a, b).pvalue)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--temperatures", nargs="+", type=float, default=[0.3, 0.1])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--out", default="rare_tokens")
    ap.add_argument("--resume", action="store_true", help="keep the engines a stopped run of --out already measured")
    args = ap.parse_args()
    if args.one:
        print_result(one_engine(json.loads(sys.stdin.readline())))
        return

    from vllm_univer.tools.real_models import DEFAULT_DRAFT, DEFAULT_TARGET, model_dir, prompts
    from vllm_univer.tools.serving_defaults import hardware_defaults

    dtype, hardware, _, hardware_env = hardware_defaults([])
    texts = [p["turns"][0] for p in prompts("humaneval", limit=args.prompts)]
    saved = RESULTS / f"{args.out}.json"
    results = json.loads(saved.read_text())["results"] if args.resume and saved.exists() else {}
    for name in args.configs:
        if name in results:
            continue
        job = {
            "target": str(model_dir(DEFAULT_TARGET)),
            "draft": str(model_dir(DEFAULT_DRAFT)),
            "dtype": dtype,
            "spec": CONFIGS[name],
            "prompts": texts,
            "tokens": args.tokens,
            "temperatures": args.temperatures,
            "seeds": list(range(args.seeds)),
        }
        start = time.perf_counter()
        result, stderr = run_json_job([__file__, "--one"], job, {**os.environ, **hardware_env, **ENV}, timeout=3600)
        if result is None:
            sys.exit(f"{name} failed:\n{stderr[-4000:]}")
        results[name] = result
        print(f"[rare_tokens] {name}: {time.perf_counter() - start:.0f} s", flush=True)
        # Saved engine by engine: a stopped run goes on with --resume.
        saved.write_text(json.dumps({"command": sys.argv, "hardware": hardware, "results": results}))
    lines = [
        "# Rare emitted tokens through vLLM (issue 61)",
        "",
        f"Command: `python -m benchmarks.rare_tokens {' '.join(sys.argv[1:])}`. Machine: {hardware}; "
        f"{platform.platform()}. Qwen2.5-Coder 1.5B target / 0.5B draft, {args.prompts} HumanEval prompts x "
        f"{args.tokens} tokens x {args.seeds} seeds per temperature, `logprobs_mode=processed_logprobs` (each "
        "emitted token's log-probability under the law it was sampled from). Rare: processed p < 1e-4. "
        "Rate difference in standard errors of the difference of two proportions; KS: two-sample "
        "Kolmogorov-Smirnov p-value of the emitted tokens' logprobs against plain decoding's.",
        "",
        "| T | engine | tokens | rare | rate | vs plain (SE) | lowest logprob | mean logprob | KS p vs plain |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for temperature in map(str, args.temperatures):
        base = np.asarray(results["plain"][temperature]) if "plain" in results else None
        for name, by_temperature in results.items():
            values = np.asarray(by_temperature[temperature])
            rare = int((values < RARE).sum())
            rate = rare / len(values)
            diff, ks = "-", "-"
            if base is not None and name != "plain":
                base_rate = float((base < RARE).mean())
                pooled = (rare + (base < RARE).sum()) / (len(values) + len(base))
                se = math.sqrt(max(pooled * (1 - pooled), 1e-12) * (1 / len(values) + 1 / len(base)))
                diff = f"{(rate - base_rate) / se:+.2f}"
                ks = f"{ks_p_value(values, base):.3f}"
            lines.append(
                f"| {temperature} | {name} | {len(values)} | {rare} | {rate:.4f} | {diff} | {values.min():.2f} | "
                f"{values.mean():.3f} | {ks} |"
            )
    text = "\n".join(lines) + "\n"
    (RESULTS / f"{args.out}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
