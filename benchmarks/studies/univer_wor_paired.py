"""univer_wor at this code against univer_wor at another commit, paired on the
same drafted trees of the real pair (exact E[accepted draft tokens] per tree).

A change to univer_wor's rule moves its value by a fraction of a token on most
trees and by several tokens on a few (where a ratio decision sends scale down
another branch), so it is read paired: each context's wor tree is drafted once
(``acceptance.draft_and_score``, the study's drafting) and scored by traversal,
by univer_wor as it is here, and by the rule of ``--against`` (its
``univer_wor.py`` loaded from git beside this one). One tree per prompt and
temperature, at the prompt's own context.

    python -m benchmarks.studies.univer_wor_paired --against 79aba6c --shape eagle61 --first 12 --prompts 20

Records go to ``results/univer_wor_paired.jsonl`` (appended), the report to
``results/univer_wor_paired.md`` (``--report-only`` rebuilds it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import platform
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.acceptance import CachedLM, draft_and_score, expected_accepted, prompt_ids, tree_shapes
from vllm_univer import TreeSpec
from vllm_univer.core.verifiers.univer_wor import UniVerWorVerifier
from vllm_univer.tools.real_models import DEFAULT_DRAFT, DEFAULT_TARGET, model_dir, prompts

HERE = Path(__file__).resolve().parents[1]  # benchmarks/

RECORDS = HERE / "results" / "univer_wor_paired.jsonl"
REPORT = HERE / "results" / "univer_wor_paired.md"
# What a rule's node_rule calls on its own class: swapped together.
RULE_METHODS = ("node_rule", "_in_pairs", "_three", "_select")


def rule_at(commit: str):
    """univer_wor's verifier class as it was at ``commit`` (its module loaded from git)."""
    # The file's home before and after the core moved into vllm_univer/core (2026-12-06).
    for home in ("vllm_univer/core/verifiers", "vllm_univer/verifiers"):
        shown = subprocess.run(
            ["git", "show", f"{commit}:{home}/univer_wor.py"], cwd=HERE.parent, capture_output=True, text=True
        )
        if shown.returncode == 0:
            break
    else:
        raise SystemExit(f"no univer_wor.py at {commit}: {shown.stderr.strip()}")
    source = shown.stdout
    source = source.replace("from ..ops import", "from vllm_univer.core.ops import")
    source = source.replace("from .base import", "from vllm_univer.core.verifiers.base import")
    path = Path("/tmp") / f"univer_wor_{commit}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"univer_wor_{commit}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.UniVerWorVerifier


def accepted_under(rule_class, tree, tokens, p, q) -> float:
    """E[accepted] of univer_wor with ``rule_class``'s rule in place of this code's."""
    own = {name: UniVerWorVerifier.__dict__[name] for name in RULE_METHODS}
    for name in RULE_METHODS:
        setattr(UniVerWorVerifier, name, rule_class.__dict__[name])
    try:
        return expected_accepted("univer_wor", tree, tokens, p, q)
    finally:
        for name, method in own.items():
            setattr(UniVerWorVerifier, name, method)


def collect(args) -> None:
    torch.set_grad_enabled(False)
    from transformers import AutoTokenizer

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE.parent, capture_output=True, text=True)
    other = rule_at(args.against)
    target = CachedLM(model_dir(DEFAULT_TARGET, "bfloat16"), getattr(torch, args.dtype))
    draft = CachedLM(model_dir(DEFAULT_DRAFT, "bfloat16"), getattr(torch, args.dtype))
    tokenizer = AutoTokenizer.from_pretrained(model_dir(DEFAULT_TARGET, "bfloat16"))
    shapes = tree_shapes(True)  # the study's, eagle61 among them; else a WxD shape
    tree = shapes[args.shape] if args.shape in shapes else TreeSpec.parse(args.shape)
    gen = torch.Generator().manual_seed(args.seed)
    sets = {name: prompts(name, limit=args.first + args.prompts) for name in ("mtbench", "humaneval", "sharegpt")}
    started = time.time()
    with open(RECORDS, "a") as sink:
        for index in range(args.first, args.first + args.prompts):
            for dataset, items in sets.items():
                if index >= len(items):
                    continue
                item = items[index]
                ids = prompt_ids(tokenizer, item, 512)
                root_target, root_draft = target.reset(ids), draft.reset(ids)
                for temperature in args.temperatures:
                    if args.time_budget and time.time() - started > args.time_budget:
                        return
                    tokens, p, q = draft_and_score(
                        target, draft, tree, "wor", temperature, root_target, root_draft, gen
                    )
                    record = {
                        "shape": args.shape,
                        "dataset": dataset,
                        "prompt": item["id"],
                        "temperature": temperature,
                        "this": head.stdout.strip(),
                        "against": args.against,
                        "traversal": expected_accepted("traversal", tree, tokens, p, q),
                        "univer_wor": expected_accepted("univer_wor", tree, tokens, p, q),
                        "univer_wor_against": accepted_under(other, tree, tokens, p, q),
                    }
                    sink.write(json.dumps(record) + "\n")
                    sink.flush()
                    print(record, f"{time.time() - started:.0f} s", flush=True)


def mean_se(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / max(1, len(values) - 1)
    return mean, math.sqrt(var / len(values))


def report(command: str) -> None:
    records = [json.loads(line) for line in RECORDS.read_text().splitlines()]
    groups = defaultdict(list)
    for r in records:
        groups[(r["shape"], r["this"], r["against"], r["temperature"])].append(r)
    lines = [
        "# univer_wor paired with an earlier rule on the real pair's wor trees",
        "",
        f"Command: `{command}`. Machine: {platform.machine()}, {platform.processor() or 'CPU'}; "
        "Qwen2.5-Coder 1.5B target / 0.5B draft (float32), MT-Bench, HumanEval and ShareGPT prompts, one wor "
        "tree per prompt and temperature at the prompt's context. Exact E[accepted draft tokens] per tree; "
        "mean over trees, differences paired (+- standard error).",
        "",
        "| tree | univer_wor at | against | T | trees | traversal | univer_wor | against | "
        "univer_wor - against | univer_wor - traversal |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (shape, this, against, temperature), rs in sorted(groups.items()):
        cols = {k: mean_se([r[k] for r in rs])[0] for k in ("traversal", "univer_wor", "univer_wor_against")}
        d_against = mean_se([r["univer_wor"] - r["univer_wor_against"] for r in rs])
        d_trav = mean_se([r["univer_wor"] - r["traversal"] for r in rs])
        lines.append(
            f"| {shape} | {this} | {against} | {temperature} | {len(rs)} | {cols['traversal']:.3f} | "
            f"{cols['univer_wor']:.3f} | {cols['univer_wor_against']:.3f} | "
            f"{d_against[0]:+.3f} +- {d_against[1]:.3f} | {d_trav[0]:+.3f} +- {d_trav[1]:.3f} |"
        )
    REPORT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", help="commit whose univer_wor rule is compared")
    ap.add_argument("--shape", default="eagle61")
    ap.add_argument("--first", type=int, default=12, help="first prompt index of each dataset")
    ap.add_argument("--prompts", type=int, default=20, help="prompts per dataset")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.3, 0.6, 1.0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=31)
    ap.add_argument("--time-budget", type=float, default=0, help="seconds; stop cleanly after this")
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    if not args.report_only:
        if not args.against:
            ap.error("--against COMMIT is needed to collect")
        collect(args)
    report("python -m benchmarks.studies.univer_wor_paired " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
