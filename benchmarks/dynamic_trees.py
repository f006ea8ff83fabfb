"""Context-aware trees (``core.dynamic_tree``) against static trees on the real
pair: exact tau per drafted tree, paired on the same contexts.

For each prompt, temperature and context (the contexts walk a target-distributed
continuation exactly as ``benchmarks/acceptance.py`` does: one lossless UniVer
step on the 2x5 ``topk1`` tree), the draft drafts:

* the static ``topk1`` trees 2x5, 3x3 and the chain 1x8 (their depth cuts give
  2x1..2x5, 3x1..3x3 and 1x1..1x8 for free: 2, 6, 14, 30, 62, 3, 12, 39 and
  1..8 nodes), verified by univer (results before 2026-12-06 have no chains);
* a context-aware tree per budget (node budget, depth, expand, children), grown
  level by level with ``plan_children`` / ``draw_children``, verified by univer
  and, as the anchor (SGLang's rule on the same trees), by target_only.

tau = 1 + E[accepted], exact per tree (``outcome_law``). The report compares, per
budget and temperature, the dynamic tree with the best static cut of at most as
many nodes, and ends with the line

    DYNAMIC worst budget: dynamic / best static tau = X.XXx (budget N, T = t);
    vs target_only on the same trees >= Y.YYx

(one line in the report).

    python -m benchmarks.dynamic_trees --prompts 3 --steps 3 --time-budget 3000
    python -m benchmarks.dynamic_trees --report-only
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.acceptance import CachedLM, draft_and_score, expected_accepted, probs, prompt_ids, truncated
from vllm_univer import TreeSpec, verify
from vllm_univer.core.dynamic_tree import DynamicTreeBudget, grow_trees
from vllm_univer.tools.real_models import DEFAULT_DRAFT, DEFAULT_TARGET, model_dir, prompts

RESULTS = Path(__file__).resolve().parent / "results"
# The chain 1x8 (cuts 1x1..1x8): what ``tree: auto`` mostly drafts on this pair.
STATIC = {"2x5": TreeSpec.parse("2x5"), "3x3": TreeSpec.parse("3x3"), "1x8": TreeSpec.parse("1x8")}
# The node budgets (8, 16, 32, 64), two level widths each (positions per
# depth: ``level_sizes``; depth as far as the budget lasts).
BUDGETS = {
    "dyn8/e1m2": DynamicTreeBudget(max_nodes=8, max_depth=4, expand=1, max_children=2),
    "dyn8/e2m2": DynamicTreeBudget(max_nodes=8, max_depth=4, expand=2, max_children=2),
    "dyn16/e2m2": DynamicTreeBudget(max_nodes=16, max_depth=6, expand=2, max_children=2),
    "dyn16/e1m3": DynamicTreeBudget(max_nodes=16, max_depth=6, expand=1, max_children=3),
    "dyn32/e3m2": DynamicTreeBudget(max_nodes=32, max_depth=8, expand=3, max_children=2),
    "dyn32/e2m3": DynamicTreeBudget(max_nodes=32, max_depth=8, expand=2, max_children=3),
    "dyn64/e4m2": DynamicTreeBudget(max_nodes=64, max_depth=10, expand=4, max_children=2),
    "dyn64/e3m3": DynamicTreeBudget(max_nodes=64, max_depth=10, expand=3, max_children=3),
}
DYNAMIC_METHODS = ("univer", "target_only")


def grow_and_score(target, draft, budget, temperature, root_target, root_draft, gen):
    """A context-aware tree for the current context, grown by the package's own
    level loop (``grow_trees``: the layout a step verifies) and scored by the target.
    Returns (TreeBatch, tokens [1, N+1], p [1, N+1, V], q [1, N+1, V])."""
    root_pos = target.length - 1
    grown = grow_trees(budget, _tree_rows(draft, probs(root_draft, temperature), root_pos, temperature), 1, gen)
    trees, tokens = grown.trees, grown.tokens
    p = _tree_rows(target, probs(root_target, temperature), root_pos, temperature)(trees.token_paths(tokens))
    missing = tokens < 0
    missing[:, 0] = False
    p[missing] = 0.0  # rows of positions without a node are never read
    return trees, tokens, p, grown.draft_probs


def _tree_rows(lm, root_row: torch.Tensor, root_pos: int, temperature: float):
    """draft_rows for ``grow_trees`` (and the target's rows) from a causal LM: the rows
    of the given paths [1, F, d] (-1 padded) from one tree forward over every distinct
    prefix of them (each sees the context and its own ancestors)."""

    def rows(paths: torch.Tensor) -> torch.Tensor:
        keys = []
        for path in paths[0].tolist():
            while path and path[-1] == -1:  # padding past the position's depth
                path = path[:-1]
            keys.append(None if -1 in path else tuple(path))
        prefixes: dict[tuple, int] = {}
        for key in filter(None, keys):
            for j in range(1, len(key) + 1):
                prefixes.setdefault(key[:j], len(prefixes))
        out = torch.zeros(1, len(keys), root_row.shape[-1], dtype=torch.float64)
        if prefixes:
            order = list(prefixes)
            visible = torch.tensor([[b == a[: len(b)] for b in order] for a in order])
            logits = lm.append_tree([k[-1] for k in order], [root_pos + len(k) for k in order], visible)
            lm.rollback()
        for f, key in enumerate(keys):
            if key == ():
                out[0, f] = root_row
            elif key is not None:
                out[0, f] = probs(logits[prefixes[key]], temperature)
        return out

    return rows


def study_context(target, draft, temperature, root_target, root_draft, gen, budgets, sink, meta):
    """Record every tree of one context; returns the 2x5 topk1 tree that advances it."""
    advance = None
    for name, tree in STATIC.items():
        tokens, p, q = draft_and_score(target, draft, tree, "topk1", temperature, root_target, root_draft, gen)
        if name == "2x5":
            advance = (tree, tokens, p, q)
        for depth in range(1, tree.max_depth + 1):
            sub = truncated(tree, depth) if depth < tree.max_depth else tree
            n1 = sub.num_nodes + 1
            tau = 1 + expected_accepted("univer", sub, tokens[:, :n1], p[:, :n1], q[:, :n1])
            sink.write(
                json.dumps(
                    {**meta, "tree": f"{name[0]}x{depth}", "nodes": sub.num_nodes, "method": "univer", "tau": tau}
                )
                + "\n"
            )
    for name in budgets:
        grown = grow_and_score(target, draft, BUDGETS[name], temperature, root_target, root_draft, gen)
        for method in DYNAMIC_METHODS:
            tau = 1 + expected_accepted(method, *grown)
            nodes = int((grown[1][0, 1:] >= 0).sum())
            sink.write(
                json.dumps(
                    {
                        **meta,
                        "tree": name,
                        "nodes": nodes,
                        "budget": BUDGETS[name].max_nodes,
                        "method": method,
                        "tau": tau,
                    }
                )
                + "\n"
            )
    sink.flush()
    return advance


def run(args) -> None:
    torch.set_grad_enabled(False)
    dtype = getattr(torch, args.dtype)
    target = CachedLM(model_dir(DEFAULT_TARGET, args.dtype), dtype)
    draft = CachedLM(model_dir(DEFAULT_DRAFT, args.dtype), dtype)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir(DEFAULT_TARGET, args.dtype))
    gen = torch.Generator().manual_seed(args.seed)
    out = RESULTS / f"{args.out}.jsonl"
    with open(out, "a") as sink:
        started = time.time()
        for index in range(args.prompts):
            for dataset in args.datasets:
                item = prompts(dataset, limit=args.prompts)[index]
                ids = prompt_ids(tokenizer, item, args.max_prompt_tokens)
                for temperature in args.temperatures:
                    if args.time_budget and time.time() - started > args.time_budget:
                        print("time budget reached; partial results kept", flush=True)
                        return
                    root_target, root_draft = target.reset(ids), draft.reset(ids)
                    for step in range(args.steps):
                        meta = {"dataset": dataset, "prompt": item["id"], "temperature": temperature, "step": step}
                        tree, tokens, p, q = study_context(
                            target, draft, temperature, root_target, root_draft, gen, args.budgets, sink, meta
                        )
                        new = [
                            t
                            for t in verify("univer", tree, tokens, p, q, generator=gen).output_token_ids[0].tolist()
                            if t >= 0
                        ]
                        if tokenizer.eos_token_id in new:
                            break
                        root_target, root_draft = target.extend(new), draft.extend(new)
                    print(f"T={temperature} {dataset} {item['id']}: {time.time() - started:.0f}s", flush=True)


def mean_se(values: list[float]) -> tuple[float, float]:
    m = sum(values) / len(values)
    var = sum((v - m) ** 2 for v in values) / max(len(values) - 1, 1)
    return m, math.sqrt(var / len(values))


def report(args) -> str:
    records = [json.loads(line) for line in (RESULTS / f"{args.out}.jsonl").read_text().splitlines()]
    cells: dict[tuple, list[float]] = defaultdict(list)
    nodes: dict[str, int] = {}
    contexts = defaultdict(set)
    for r in records:
        key = (r["temperature"], r["tree"], r["method"])
        cells[key].append(r["tau"])
        contexts[r["temperature"]].add((r["prompt"], r["step"]))
        if "budget" in r:
            nodes[r["tree"]] = r["budget"]
        else:
            nodes[r["tree"]] = r["nodes"]
    temps = sorted(contexts)
    cmd = (RESULTS / f"{args.out}.cmd").read_text().strip() if (RESULTS / f"{args.out}.cmd").exists() else ""
    lines = [
        "# Context-aware trees against static trees (exact tau, paired contexts)",
        "",
        f"Commands:\n\n```\n{cmd}\n```\n",
        f"Machine: {platform.platform()}, {platform.machine()}. Qwen2.5-Coder 1.5B target / 0.5B draft, "
        f"{args.dtype}. Contexts per temperature: {', '.join(f'T={t}: {len(contexts[t])}' for t in temps)}. "
        "tau = 1 + E[accepted], exact per drafted tree; +- one standard error over contexts. Static trees: "
        "topk1 drafts, univer; a dynamic tree's nodes are its budget (the slots it may fill).",
        "",
        "| T | tree | nodes | univer tau | target_only tau | dynamic / best static (<= nodes) | univer / target_only |",
        "|---|---|---|---|---|---|---|",
    ]
    best_width: dict[tuple, tuple] = {}  # (T, budget) -> (ratio, config) of its better level width
    worst_config, worst_anchor = None, None
    for t in temps:
        static = {
            tree: mean_se(v) for (tt, tree, m), v in cells.items() if tt == t and m == "univer" and "dyn" not in tree
        }
        for tree in sorted(static, key=lambda s: (nodes[s], s)):
            m, se = static[tree]
            lines.append(f"| {t} | {tree} | {nodes[tree]} | {m:.3f} +- {se:.3f} | | | |")
        for tree in sorted({k[1] for k in cells if k[0] == t and "dyn" in k[1]}, key=lambda s: (nodes[s], s)):
            u, use = mean_se(cells[(t, tree, "univer")])
            a, _ = mean_se(cells[(t, tree, "target_only")])
            best = max((static[s][0] for s in static if nodes[s] <= nodes[tree]), default=float("nan"))
            ratio, anchor = u / best, u / a
            lines.append(
                f"| {t} | {tree} | {nodes[tree]} | {u:.3f} +- {use:.3f} | {a:.3f} | {ratio:.3f}x | {anchor:.3f}x |"
            )
            if best_width.get((t, nodes[tree]), (0.0,))[0] < ratio:
                best_width[(t, nodes[tree])] = (ratio, tree)
            if worst_config is None or ratio < worst_config[0]:
                worst_config = (ratio, tree, t)
            if t == 1.0 and (worst_anchor is None or anchor < worst_anchor):
                worst_anchor = anchor
    lines.append("")
    if best_width:
        (t, budget), (ratio, _) = min(best_width.items(), key=lambda kv: kv[1][0])
        worst = (ratio, budget, t)
        lines.append(
            f"Per budget the better level width is taken (chosen on these same contexts); the worst single "
            f"configuration: {worst_config[1]} at T = {worst_config[2]}, {worst_config[0]:.2f}x."
        )
        lines.append("")
        lines.append(
            f"DYNAMIC worst budget: dynamic / best static tau = {worst[0]:.2f}x (budget {worst[1]}, T = {worst[2]}); "
            f"vs target_only on the same trees >= {worst_anchor if worst_anchor is not None else float('nan'):.2f}x"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", nargs="+", default=["mtbench", "humaneval"])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.3, 0.6, 1.0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--budgets", nargs="+", default=list(BUDGETS), choices=list(BUDGETS))
    ap.add_argument("--max-prompt-tokens", type=int, default=384)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-budget", type=float, default=0)
    ap.add_argument("--out", default="dynamic_trees")
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    if not args.report_only:
        with open(RESULTS / f"{args.out}.cmd", "a") as cmd:
            cmd.write(
                f"{time.strftime('%Y-%m-%d %H:%M')}  python -m benchmarks.dynamic_trees {' '.join(sys.argv[1:])}\n"
            )
        run(args)
    text = report(args)
    (RESULTS / f"{args.out}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
