"""Acceptance study on real models: exact expected accepted length per verifier.

Reproduces the layout of the UniVer / Traversal Verification papers' tables
(tau = accepted draft tokens + 1, gain over RRSw) with the Qwen2.5-Coder
1.5B target / 0.5B draft pair (vllm_univer/tools/real_models.py), transformers and a tree
attention mask; vLLM is not needed.

Method. For each prompt (chat template) and temperature T, the study walks a
target-distributed continuation: at each position (context) and for each draft
scheme, the draft model drafts the tree level by level at temperature T, the
target scores every node in one forward, and ``outcome_law`` gives each
verifier's *exact* expected accepted length for that tree. Methods sharing a
scheme share the tree (greedy, univer, target_only: ``topk1``; rrsw,
traversal, univer_wor: ``wor``; token, block: ``chain``). The context then advances by one
UniVer step on the ``topk1`` tree, which is lossless, so contexts stay
target-distributed at temperature T.

    python -m benchmarks.acceptance --quick        # ~10 minutes on 2 cores
    python -m benchmarks.acceptance                # full run: hours; partial results as it goes
    python -m benchmarks.acceptance --report-only  # tables and plots from the saved records

Outputs in benchmarks/results/: acceptance[_quick].jsonl (one record per
context, scheme and method), acceptance[_quick].md (tables), and PNG plots.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from vllm_univer import TreeSpec, draft_children, outcome_law, verify
from vllm_univer.tools.real_models import DEFAULT_DRAFT, DEFAULT_TARGET, MODELS, model_dir, prompts

RESULTS = Path(__file__).parent / "results"
SCHEME_METHODS = {
    "chain": ("token", "block"),
    "wor": ("rrsw", "traversal", "univer_wor"),
    "topk1": ("greedy", "univer", "target_only"),
}
METHOD_ORDER = ("token", "block", "rrsw", "traversal", "univer_wor", "greedy", "target_only", "univer")


def eagle_like_tree(top_child_slot: int = 0) -> TreeSpec:
    """An irregular tree of 61 nodes and depth 6, shaped like EAGLE's default
    trees: wide near the root, thinner deeper, and a branch gets fewer children
    the further it strays from the most likely tokens (its deviation r = number
    of non-first ranks on its path plus its own rank; children = width[d] - r).

    ``top_child_slot`` says which slot holds rank 0, the most likely child: 0 for
    ``wor`` (the first sample), 1 for ``topk1`` (slot 1 is the top-1 token and
    slot 0 the sample from the residual, which is ranked last)."""
    width = (4, 4, 4, 3, 3, 2)
    ranked, frontier = [], [()]
    for depth in range(len(width)):
        nxt = []
        for path in frontier:
            deviation = sum(1 for r in path if r > 0) + (path[-1] if path else 0)
            nxt.extend(path + (r,) for r in range(max(0, width[depth] - deviation)))
        ranked += nxt
        frontier = nxt
    if top_child_slot == 0:
        return TreeSpec.from_paths(ranked)
    siblings = {}
    for path in ranked:
        siblings[path[:-1]] = max(siblings.get(path[:-1], 0), path[-1] + 1)

    def to_slots(path):  # rank r of m siblings -> slot (r + 1) mod m
        return tuple((r + 1) % siblings[path[:i]] for i, r in enumerate(path))

    return TreeSpec.from_paths([to_slots(p) for p in ranked])


def tree_shapes(full: bool) -> dict[str, TreeSpec]:
    shapes = {"1x5": TreeSpec.parse("1x5"), "2x5": TreeSpec.parse("2x5")}
    if full:
        shapes["3x3"] = TreeSpec.parse("3x3")
        shapes["eagle61"] = eagle_like_tree()
        shapes["eagle61t"] = eagle_like_tree(top_child_slot=1)
    return shapes


# Schemes drafted on each shape (default: chain on chains, wor and topk1 on trees).
# eagle61t is eagle61 with its heavy branch on slot 1, the top-1 token of topk1.
SHAPE_SCHEMES = {"eagle61t": ("topk1",)}


class CachedLM:
    """A causal LM with a KV cache of the current context; tree queries are
    appended under a tree mask and rolled back afterwards."""

    def __init__(self, path: Path, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        self.cache = None
        self.length = 0

    def reset(self, ids: list[int]) -> torch.Tensor:
        self.cache, self.length = None, 0
        return self.extend(ids)

    def extend(self, ids: list[int]) -> torch.Tensor:
        """Append tokens to the context; returns the float32 logits after the last one [V]."""
        x = torch.tensor([ids])
        out = self.model(x, past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        self.length += len(ids)
        return out.logits[0, -1].float()

    def append_tree(self, tokens: list[int], positions: list[int], visible: torch.Tensor) -> torch.Tensor:
        """Append tree tokens that see the whole context and the appended tokens
        where ``visible`` [n, appended so far + n] is True; returns logits [n, V]."""
        n = len(tokens)
        ctx = torch.ones(n, self.length, dtype=torch.bool)
        mask = torch.cat([ctx, visible], 1)[None, None]
        out = self.model(
            torch.tensor([tokens]),
            position_ids=torch.tensor([positions]),
            attention_mask=mask,
            past_key_values=self.cache,
            use_cache=True,
        )
        self.cache = out.past_key_values
        return out.logits[0].float()

    def rollback(self) -> None:
        """Drop every appended tree token, back to the context."""
        extra = self.cache.get_seq_length() - self.length
        if extra > 0:
            self.cache.crop(-extra)


def probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return (logits.double() / temperature).softmax(-1)


def draft_and_score(
    target: CachedLM,
    draft: CachedLM,
    tree: TreeSpec,
    scheme: str,
    temperature: float,
    root_target: torch.Tensor,
    root_draft: torch.Tensor,
    gen: torch.Generator,
):
    """Draft ``tree`` with ``scheme`` level by level and score it with the target.

    Returns tokens [1, N+1], p [1, N+1, V], q [1, N+1, V] (float64)."""
    n1 = tree.num_nodes + 1
    vocab = root_target.shape[-1]
    root_pos = target.length - 1
    tokens = torch.full((n1,), -1, dtype=torch.long)
    q = torch.zeros(n1, vocab, dtype=torch.float64)
    q[0] = probs(root_draft, temperature)
    depth = tree.depth.tolist()
    anc = tree.ancestor_mask[1:, 1:]  # among draft nodes 1..N
    levels = [[i for i in range(1, n1) if depth[i] == d] for d in range(1, tree.max_depth + 1)]
    children = tree.children.tolist()
    for d, level in enumerate(levels, start=1):
        parents = sorted({int(tree.parent[i]) for i in level})
        for v in parents:  # children of each parent, drawn from its exact q row
            kids = [c for c in children[v] if c >= 0]
            if v == 0 or tokens[v] >= 0:
                tokens[kids] = draft_children(scheme, q[v : v + 1], len(kids), generator=gen)[0]
        if d == tree.max_depth:
            break  # leaves need no draft row
        placeholder = [max(int(tokens[i]), 0) for i in level]  # missing nodes: any token, ignored
        first, last = level[0], level[-1]
        logits = draft.append_tree(placeholder, [root_pos + d] * len(level), anc[first - 1 : last, :last])
        q[first : last + 1] = probs(logits, temperature)
    draft.rollback()

    nodes = list(range(1, n1))
    placeholder = [max(int(tokens[i]), 0) for i in nodes]
    logits = target.append_tree(placeholder, [root_pos + depth[i] for i in nodes], anc)
    target.rollback()
    p = torch.empty(n1, vocab, dtype=torch.float64)
    p[0] = probs(root_target, temperature)
    p[1:] = probs(logits, temperature)
    # Rows of missing nodes are never read; zero them to keep the inputs clean.
    missing = tokens < 0
    missing[0] = False
    p[missing] = 0.0
    q[missing] = 0.0
    return tokens.unsqueeze(0), p.unsqueeze(0), q.unsqueeze(0)


def expected_accepted(method: str, tree: TreeSpec, tokens, p, q) -> float:
    law = outcome_law(method, tree, tokens, p, q)
    return float((law.sum(-1) * tree.depth.double()).sum())


def shape_label(shape: str, depth: int, full_depth: int) -> str:
    """'2x5' truncated at depth 3 is '2x3'; an irregular shape 'eagle61' at depth 3 is 'eagle61@3'."""
    if "x" in shape and shape.replace("x", "").isdigit():
        return f"{shape.split('x')[0]}x{depth}"
    return shape if depth == full_depth else f"{shape}@{depth}"


def truncated(tree: TreeSpec, depth: int) -> TreeSpec:
    return TreeSpec([path for path in tree.paths if len(path) <= depth])


def study_prompt(item, dataset, ids, temperature, target, draft, tokenizer, shapes, steps, sink, gen, schemes=None):
    """Walk ``steps`` contexts of one prompt at one temperature, recording every
    method of ``schemes`` (default: all). The 2x5 topk1 tree, which advances the
    context, is drafted whatever ``schemes`` and ``shapes`` say."""
    root_target = target.reset(ids)
    root_draft = draft.reset(ids)
    for step in range(steps):
        trees = {}
        for shape_name, tree in shapes.items():
            for scheme in SHAPE_SCHEMES.get(shape_name, ("chain",) if tree.is_chain else ("wor", "topk1")):
                recorded = not schemes or scheme in schemes
                if not recorded and (shape_name, scheme) != ("2x5", "topk1"):  # that one advances the context
                    continue
                tokens, p, q = draft_and_score(target, draft, tree, scheme, temperature, root_target, root_draft, gen)
                trees[(shape_name, scheme)] = (tree, tokens, p, q)
                if not recorded:
                    continue
                # Truncating a drafted tree at depth k gives a tree of the same scheme
                # (levels are drafted top-down), so every shallower shape is free.
                for depth in range(1, tree.max_depth + 1):
                    sub = truncated(tree, depth) if depth < tree.max_depth else tree
                    n1 = sub.num_nodes + 1
                    for method in SCHEME_METHODS[scheme]:
                        acc = expected_accepted(method, sub, tokens[:, :n1], p[:, :n1], q[:, :n1])
                        sink.write(
                            json.dumps(
                                {
                                    "dataset": dataset,
                                    "category": item["category"],
                                    "prompt": item["id"],
                                    "temperature": temperature,
                                    "step": step,
                                    "tree": shape_label(shape_name, depth, tree.max_depth),
                                    "nodes": sub.num_nodes,
                                    "method": method,
                                    "accepted": acc,
                                }
                            )
                            + "\n"
                        )
        sink.flush()
        # Advance by one lossless UniVer step on the 2x5 topk1 tree (drafted here
        # when the study records other shapes only, so every run walks the same contexts).
        if ("2x5", "topk1") not in trees:
            tree = TreeSpec.parse("2x5")
            trees[("2x5", "topk1")] = (
                tree,
                *draft_and_score(target, draft, tree, "topk1", temperature, root_target, root_draft, gen),
            )
        tree, tokens, p, q = trees[("2x5", "topk1")]
        out = verify("univer", tree, tokens, p, q, generator=gen)
        new = [t for t in out.output_token_ids[0].tolist() if t >= 0]
        if tokenizer.eos_token_id in new:
            break
        root_target = target.extend(new)
        root_draft = draft.extend(new)


def prompt_ids(tokenizer, item, max_tokens: int) -> list[int]:
    """The token ids of a prompt set item's first turn in the chat template, its last ``max_tokens``."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": item["turns"][0]}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False).input_ids[-max_tokens:]


def records_path(args) -> Path:
    supplement = f".supp-{args.supplement}" if args.supplement else ""
    return RESULTS / f"acceptance{'_quick' if args.quick else ''}{supplement}.jsonl"


def run_study(args) -> Path:
    torch.set_grad_enabled(False)
    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    target = CachedLM(model_dir(args.target, args.dtype), dtype)
    draft = CachedLM(model_dir(args.draft, args.dtype), dtype)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir(args.target, args.dtype))
    shapes = tree_shapes(not args.quick)
    if args.shapes:
        shapes = {name: tree_shapes(True)[name] for name in args.shapes}
    datasets = {name: prompts(name, limit=args.prompts) for name in args.datasets}
    out_path = records_path(args)
    RESULTS.mkdir(exist_ok=True)
    done = set()
    if out_path.exists() and not args.restart:
        for line in out_path.read_text().splitlines():
            r = json.loads(line)
            done.add((r["prompt"], r["temperature"]))  # resume: skip finished prompts
    sink = open(out_path, "w" if args.restart else "a")
    with open(out_path.with_suffix(".cmd"), "w" if args.restart else "a") as cmd:
        cmd.write(f"{time.strftime('%Y-%m-%d %H:%M')}  python -m benchmarks.acceptance {' '.join(sys.argv[1:])}\n")
    gen = torch.Generator().manual_seed(args.seed)
    started = time.time()
    # Prompts outermost, then datasets and temperatures: a run stopped by its
    # time budget leaves balanced partial results.
    for index in range(max(len(items) for items in datasets.values())):
        for dataset, items in datasets.items():
            if index >= len(items):
                continue
            item = items[index]
            ids = prompt_ids(tokenizer, item, args.max_prompt_tokens)
            for temperature in args.temperatures:
                if args.time_budget and time.time() - started > args.time_budget:
                    print("time budget reached; partial results kept", flush=True)
                    sink.close()
                    return out_path
                if (item["id"], temperature) in done:
                    continue
                study_prompt(
                    item,
                    dataset,
                    ids,
                    temperature,
                    target,
                    draft,
                    tokenizer,
                    shapes,
                    args.steps,
                    sink,
                    gen,
                    args.schemes,
                )
                print(f"T={temperature} {dataset} {item['id']}: {time.time() - started:.0f}s", flush=True)
    sink.close()
    return out_path


# ------------------------------------------------------------------ report
def mean_and_se(values):
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return mean, math.sqrt(var / n) if n > 1 else float("nan")


def _context(record) -> tuple:
    """The context a record was measured at: (run, prompt, temperature, step)."""
    return record["run"], record["prompt"], record["temperature"], record["step"]


def study_records(jsonl: Path) -> tuple[list[Path], list[dict]]:
    """The study's record files (the run and its supplements) and their records,
    each tagged with its run (a run's contexts are not the other runs' contexts)."""
    files = [jsonl] + sorted(jsonl.parent.glob(f"{jsonl.stem}.supp-*.jsonl"))
    records = [dict(json.loads(line), run=f.stem) for f in files for line in f.read_text().splitlines() if line.strip()]
    return files, records


def report(jsonl: Path, command: str) -> Path:
    files, records = study_records(jsonl)
    groups = defaultdict(list)
    for r in records:
        keys = [r["dataset"], "overall"]
        if r["dataset"] == "mtbench":
            keys.append(f"mtbench/{r['category']}")  # MT-Bench per category
        for dataset in keys:
            groups[(dataset, r["temperature"], r["tree"], r["method"])].append(r["accepted"] + 1.0)
    temps = sorted({r["temperature"] for r in records})
    trees = [t for t in ("1x5", "2x5", "3x3", "eagle61", "eagle61t") if any(r["tree"] == t for r in records)]
    datasets = sorted({r["dataset"] for r in records}) + ["overall"]
    categories = sorted({f"mtbench/{r['category']}" for r in records if r["dataset"] == "mtbench"})
    contexts = len({_context(r) for r in records})

    runs = [
        line.strip()
        for f in files
        if f.with_suffix(".cmd").exists()
        for line in f.with_suffix(".cmd").read_text().splitlines()
        if line.strip()
    ]
    lines = [
        "# Acceptance study: exact expected tokens per step (tau)",
        "",
        "Records produced by:",
        "",
        *[f"- `{r}`" for r in runs],
        "",
        f"Report: `{command}`",
        "",
        f"Target {DEFAULT_TARGET} ({MODELS[DEFAULT_TARGET].filename}, sha256 {MODELS[DEFAULT_TARGET].sha256[:16]}...), "
        f"draft {DEFAULT_DRAFT} ({MODELS[DEFAULT_DRAFT].filename}, sha256 {MODELS[DEFAULT_DRAFT].sha256[:16]}...).",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}. "
        f"{contexts} (context, temperature) pairs.",
        "",
        "tau = 1 + E[accepted draft tokens | tree], exact per drafted tree (outcome_law), "
        "averaged over contexts; +- is the standard error. Gain: over `rrsw` on trees, over `token` on the chain.",
        "",
    ]
    # The two layouts of the UniVer paper's tables (shared/seeds).
    tree_cols = [t for t in ("2x5", "3x3", "eagle61", "eagle61t") if t in trees]
    seed_methods = ("rrsw", "traversal", "univer_wor", "greedy", "univer")

    def cell(dataset, t, tree, m):
        # eagle61t (topk1 only) is compared with RRSw on eagle61, its wor orientation.
        base_tree = "eagle61" if tree == "eagle61t" else tree
        vals, base = groups.get((dataset, t, tree, m)), groups.get((dataset, t, base_tree, "rrsw"))
        if not vals or not base:
            return ""
        mean, base_mean = mean_and_se(vals)[0], mean_and_se(base)[0]
        return f"{mean:.2f} ({100 * (mean / base_mean - 1):+.1f}%)"

    if "2x5" in trees:
        t_top = max(temps)
        ds = [d for d in datasets if d != "overall"] + ["overall"]
        lines += [
            f"## Paper layout 1: tau (gain over RRSw) per dataset, tree 2x5, T={t_top}",
            "",
            "| method | " + " | ".join(ds) + " |",
            "|---|" + "---|" * len(ds),
        ]
        for m in seed_methods:
            lines.append(f"| {m} | " + " | ".join(cell(d, t_top, "2x5", m) for d in ds) + " |")
        lines.append("")
    if tree_cols:
        lines += [
            "## Paper layout 2: tau (gain over RRSw) per temperature and tree shape, overall",
            "",
            "| T | method | " + " | ".join(tree_cols) + " |",
            "|---|---|" + "---|" * len(tree_cols),
        ]
        for t in temps:
            for m in seed_methods:
                lines.append(f"| {t} | {m} | " + " | ".join(cell("overall", t, tc, m) for tc in tree_cols) + " |")
        lines.append("")

    for tree in trees:
        base = "token" if tree == "1x5" else "rrsw"
        methods = [m for m in METHOD_ORDER if any(k[2] == tree and k[3] == m for k in groups)]
        for dataset in datasets:
            if not any(k[0] == dataset and k[2] == tree for k in groups):
                continue
            lines += [
                f"## tree {tree}, {dataset}",
                "",
                "| method | " + " | ".join(f"T={t} tau | gain" for t in temps) + " |",
                "|---|" + "---|---|" * len(temps),
            ]
            for m in methods:
                cells = []
                for t in temps:
                    vals = groups.get((dataset, t, tree, m))
                    basevals = groups.get((dataset, t, tree, base))
                    if not vals:
                        cells += ["", ""]
                        continue
                    mean, se = mean_and_se(vals)
                    gain = f"{100 * (mean / mean_and_se(basevals)[0] - 1):+.1f}%" if basevals else ""
                    cells += [f"{mean:.3f} +- {se:.3f}", gain]
                lines.append(f"| {m} | " + " | ".join(cells) + " |")
            lines.append("")
    if categories:
        lines += [
            "## MT-Bench per category, tree 2x5",
            "",
            "| category | T | contexts | rrsw | traversal | univer_wor | greedy | univer |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for cat in categories:
            for t in temps:
                cells = [
                    groups.get((cat, t, "2x5", m)) for m in ("rrsw", "traversal", "univer_wor", "greedy", "univer")
                ]
                if all(cells):
                    lines.append(
                        f"| {cat.split('/')[1]} | {t} | {len(cells[0])} | "
                        + " | ".join(f"{mean_and_se(c)[0]:.3f}" for c in cells)
                        + " |"
                    )
        lines.append("")
    # Paired by context: both verifiers at the same context; same-scheme pairs
    # (univer/greedy, traversal/rrsw, block/token) even judged the very same tree.
    by_key = {(*_context(r), r["tree"], r["method"]): r["accepted"] for r in records}
    pairs = (
        ("univer", "greedy"),
        ("traversal", "rrsw"),
        ("univer_wor", "traversal"),
        ("block", "token"),
        ("univer", "rrsw"),
        ("greedy", "rrsw"),
    )
    lines += [
        "## Paired differences at the same contexts (overall)",
        "",
        "Same-scheme pairs share the drafted tree; univer/greedy vs rrsw compare a topk1 tree and a wor "
        "tree drafted at the same context.",
        "",
        "| tree | T | comparison | mean tau difference | +- | relative |",
        "|---|---|---|---|---|---|",
    ]
    for tree in trees:
        for t in temps:
            for a, b in pairs:
                diffs, base_vals = [], []
                for (run, prompt, temp, step, tr, m), acc in by_key.items():
                    if m == b and tr == tree and temp == t and (run, prompt, temp, step, tr, a) in by_key:
                        diffs.append(by_key[(run, prompt, temp, step, tr, a)] - acc)
                        base_vals.append(acc + 1.0)
                if len(diffs) > 1:
                    mean, se = mean_and_se(diffs)
                    rel = 100 * mean / (sum(base_vals) / len(base_vals))
                    lines.append(f"| {tree} | {t} | {a} - {b} | {mean:+.4f} | {se:.4f} | {rel:+.2f}% |")
    lines.append("")
    depth_rows = [t for t in ("2x2", "2x3", "2x4", "2x5") if any(k[2] == t for k in groups)]
    if depth_rows:
        lines += [
            "## tau vs binary tree depth (overall)",
            "",
            "| T | method | " + " | ".join(depth_rows) + " |",
            "|---|---|" + "---|" * len(depth_rows),
        ]
        for t in temps:
            for m in ("rrsw", "traversal", "univer_wor", "greedy", "univer"):
                cells = [
                    f"{mean_and_se(groups[('overall', t, d, m)])[0]:.3f}" if groups.get(("overall", t, d, m)) else ""
                    for d in depth_rows
                ]
                lines.append(f"| {t} | {m} | " + " | ".join(cells) + " |")
        lines.append("")
    nodes = {r["tree"]: r["nodes"] for r in records if "nodes" in r}
    if nodes:
        lines += [
            "## Best tree shape per node budget (overall)",
            "",
            "Every drafted tree truncated at each depth is a tree of its scheme, so shapes "
            "1x1..1x5, 2x1..2x5, 3x1..3x3 and the irregular tree's depth truncations are all measured.",
            "",
            *_best_shape_table(groups, temps, nodes),
            "",
            *_context_sets(records),
        ]
        shared = _shared_contexts(records)
        if shared and len({r["run"] for r in records}) > 1:
            shared_groups = defaultdict(list)
            for r in records:
                if _context(r) in shared:
                    shared_groups[("overall", r["temperature"], r["tree"], r["method"])].append(r["accepted"] + 1.0)
            counts = ", ".join(
                f"{sum(1 for c in shared if c[2] == t)} at T={t}" for t in temps if any(c[2] == t for c in shared)
            )
            lines += [
                "",
                "## Best tree shape per node budget, on the contexts every tree method shares",
                "",
                f"Like for like: only the contexts at which every tree method was recorded ({counts}; "
                "only the shapes drafted there).",
                "",
                *_best_shape_table(shared_groups, temps, nodes),
            ]
        lines.append("")
    md = jsonl.with_suffix(".md")
    md.write_text("\n".join(lines) + "\n")
    _plots(groups, temps, depth_rows, jsonl.stem)
    return md


def _best_shape_table(groups, temps, nodes) -> list[str]:
    """Per temperature and method, the best measured shape within 16, 32 and 64 nodes."""
    lines = ["| T | method | budget 16 | budget 32 | budget 64 |", "|---|---|---|---|---|"]
    for t in temps:
        for m in METHOD_ORDER:
            cells = []
            for budget in (16, 32, 64):
                best = None
                for label, n in nodes.items():
                    vals = groups.get(("overall", t, label, m))
                    if n <= budget and vals and (best is None or mean_and_se(vals)[0] > best[1]):
                        best = (label, mean_and_se(vals)[0], n)
                cells.append(f"{best[0]} ({best[2]} nodes): {best[1]:.3f}" if best else "")
            if any(cells):
                lines.append(f"| {t} | {m} | " + " | ".join(cells) + " |")
    return lines


def _shared_contexts(records) -> set:
    """(run, prompt, temperature, step) at which every tree method of the records
    (all but the chain methods token and block) was recorded."""
    contexts = defaultdict(set)
    for r in records:
        if r["method"] not in ("token", "block"):
            contexts[r["method"]].add(_context(r))
    return set.intersection(*contexts.values()) if contexts else set()


def _context_sets(records) -> list[str]:
    """Which runs each method was recorded in: a table over all runs compares methods
    recorded in different runs on different contexts (only the paired differences
    are like for like)."""
    runs = defaultdict(set)
    contexts = defaultdict(set)
    for r in records:
        runs[r["method"]].add(r["run"])
        contexts[r["method"]].add(_context(r))
    groups = defaultdict(list)
    for m in METHOD_ORDER:
        if m in runs:
            groups[tuple(sorted(runs[m]))].append(m)
    if len(groups) < 2:
        return []
    lines = ["Contexts behind each row (runs differ in prompts and draws: rows from different runs are not paired):"]
    lines.append("")
    for run_set, methods in groups.items():
        lines.append(f"- {', '.join(methods)}: {len(contexts[methods[0]])} contexts, runs {', '.join(run_set)}")
    return lines


def _plots(groups, temps, depth_rows, stem) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m in ("rrsw", "traversal", "univer_wor", "greedy", "target_only", "univer"):
        ys = [mean_and_se(groups[("overall", t, "2x5", m)]) for t in temps if groups.get(("overall", t, "2x5", m))]
        if len(ys) == len(temps):
            ax.errorbar(temps, [y[0] for y in ys], yerr=[y[1] for y in ys], marker="o", label=m, capsize=3)
    ax.set_xlabel("temperature")
    ax.set_ylabel("tau (tokens per step)")
    ax.set_title("Binary tree of depth 5 (62 draft nodes)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / f"{stem}_tau_vs_temperature.png", dpi=120)
    plt.close(fig)

    if depth_rows:
        fig, ax = plt.subplots(figsize=(6, 4))
        sizes = [TreeSpec.parse(d).num_nodes for d in depth_rows]
        for m in ("rrsw", "traversal", "univer_wor", "greedy", "univer"):
            t = max(temps)
            ys = [mean_and_se(groups[("overall", t, d, m)])[0] for d in depth_rows if groups.get(("overall", t, d, m))]
            if len(ys) == len(depth_rows):
                ax.plot(sizes, ys, marker="o", label=m)
        ax.set_xlabel("draft nodes (binary tree, depth 2..5)")
        ax.set_ylabel("tau (tokens per step)")
        ax.set_title(f"tau vs tree size, T={max(temps)}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(RESULTS / f"{stem}_tau_vs_tree_size.png", dpi=120)
        plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="T=1 and 0.6, trees 1x5 and 2x5, a few prompts, ~10 min")
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--datasets", nargs="+", default=["mtbench", "humaneval", "sharegpt"])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.3, 0.6, 1.0])
    ap.add_argument("--prompts", type=int, default=40, help="prompts per dataset")
    ap.add_argument("--steps", type=int, default=8, help="contexts (speculative steps) per prompt")
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--time-budget", type=float, default=0, help="seconds; stop cleanly after this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--restart", action="store_true", help="discard earlier records of this mode")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--shapes", nargs="+", help="tree shapes to draft (default: all of the mode)")
    ap.add_argument(
        "--schemes", nargs="+", choices=sorted(SCHEME_METHODS), help="draft schemes to record (default: all)"
    )
    ap.add_argument(
        "--supplement",
        default="",
        help="write records to acceptance[_quick].supp-<name>.jsonl; "
        "the report merges every such file with the main one",
    )
    args = ap.parse_args()
    if args.quick:
        args.datasets = ["mtbench", "humaneval"]
        args.temperatures = [1.0, 0.6] if args.temperatures == [0.3, 0.6, 1.0] else args.temperatures
        args.prompts = min(args.prompts, 3)
        args.steps = min(args.steps, 5)
        args.time_budget = args.time_budget or 540
    command = "python -m benchmarks.acceptance " + " ".join(sys.argv[1:])
    if not args.report_only:
        run_study(args)
    main_path = RESULTS / f"acceptance{'_quick' if args.quick else ''}.jsonl"
    print(report(main_path, command).read_text())


if __name__ == "__main__":
    main()
