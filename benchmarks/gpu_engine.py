"""One-command engine benchmark for a GPU machine: tree speculation against vLLM's
own ``draft_model`` chain and no speculation, real model sizes, side by side in one run.

Models are real-size shapes with random weights (``load_format="dummy"``: only a
``config.json`` written here, ``skip_tokenizer_init`` with token-id prompts), so
nothing is downloaded: a Qwen2.5-7B-shaped target with a Qwen2.5-0.5B-shaped
draft, and optionally the 1.5B / 0.5B pair. Random weights accept almost no
draft, so each row measures the *time of a step* (decode only: the wall time of
generating M tokens minus that of 1 token, over the steps in between), split
with the package's step timers into verification, draft forwards, the drafter's
own work and the rest (target forward, sampler, scheduler); and takes tau, the
mean tokens per step, from the acceptance study on the real Qwen pair
(``results/acceptance.jsonl``, same verifier, shape, T = 1). Projected tokens/s
= batch x tau / step time.

    python -m benchmarks.gpu_engine                  # 7B/0.5B, batch 1 8 32, about 6 min on one H200
    python -m benchmarks.gpu_engine --pairs 7b 1.5b  # both pairs
    python -m benchmarks.gpu_engine --pairs tiny --batches 1 2 --eager   # smoke test on a CPU

Results: ``results/gpu_engine.md`` (``--out``), ending with the line the goal of
issue 12 is read from. Every engine runs in its own process; an engine that
fails is reported as such and the others go on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

from vllm_univer.integration.tree_sizer import FIXED_HAZARDS_ENV
from vllm_univer.tools.json_job import TIMED_OUT, print_result, run_json_job
from vllm_univer.tools.serving_defaults import LOCAL_SERVER_ENV

HERE = Path(__file__).resolve().parent
STUDY = HERE / "results" / "acceptance.jsonl"
# In-process engine core: the step timers are read and switched through collective_rpc with functions.
ENV = {**LOCAL_SERVER_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}

# Qwen2.5 shapes (public config.json values). The 7B's vocabulary is padded to
# 152064 in its release; the pair here shares the 0.5B's 151936 (a draft must
# have its target's vocabulary), which changes no cost that matters.
QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "use_sliding_window": False,
}
SHAPES = {
    "qwen2.5-7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
    "qwen2.5-1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen2.5-0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    # CPU smoke test only.
    "tiny-target": dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    ),
    "tiny-draft": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
    ),
}
TINY = dict(tie_word_embeddings=False, vocab_size=512, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)
for _name in ("tiny-target", "tiny-draft"):
    SHAPES[_name].update(TINY)
PAIRS = {
    "7b": ("qwen2.5-7b", "qwen2.5-0.5b"),
    "1.5b": ("qwen2.5-1.5b", "qwen2.5-0.5b"),
    "tiny": ("tiny-target", "tiny-draft"),
}

# (row name, speculative config without the draft model, (study tree, study method) for tau)
# Most telling first: a run cut short by --deadline keeps the rows that decide the goal.
ROWS = [
    ("no speculation", None, None),
    ("vLLM chain k=3", {"method": "draft_model", "num_speculative_tokens": 3}, ("1x3", "token")),
    ("univer 2x3", {"method": "univer", "tree": "2x3"}, ("2x3", "univer")),
    # Opt-in full CUDA graphs for batches of whole trees (FULL_AND_PIECEWISE, tree attention over
    # persistent buffers): the same tree and tau as "univer 2x3", one graph replay per target forward,
    # one per uniform draft level (DraftLevelGraphs) and one per sampled verification (VerifyGraphs).
    ("univer 2x3 full graphs", {"method": "univer", "tree": "2x3", "cuda_graphs": "full"}, ("2x3", "univer")),
    # tree auto (max_tree 2x5): its choice runs on this machine's costs and on the study's
    # acceptance (fixed hazards, ``auto_hazards``); tau: the study's, over the cuts it drafted.
    ("univer auto", {"method": "univer", "tree": "auto"}, ("auto", "univer")),
    # The same under full CUDA graphs: the target's own graphs for each cut's length (full_graph_lengths),
    # so a step cut to a chain or a shallower tree replays a graph as the whole tree does.
    ("univer auto full graphs", {"method": "univer", "tree": "auto", "cuda_graphs": "full"}, ("auto", "univer")),
    ("vLLM chain k=5", {"method": "draft_model", "num_speculative_tokens": 5}, ("1x5", "token")),
    ("univer 2x5", {"method": "univer", "tree": "2x5"}, ("2x5", "univer")),
    ("univer 3x3", {"method": "univer", "tree": "3x3"}, ("3x3", "univer")),
    ("traversal 2x5", {"method": "univer", "tree": "2x5", "verifier": "traversal"}, ("2x5", "traversal")),
    ("traversal auto", {"method": "univer", "tree": "auto", "verifier": "traversal"}, ("auto", "traversal")),
    # A control, not a contender (the goal compares with the rows named "vLLM chain"): vLLM's
    # chain in the modes method univer runs in, piecewise graphs and sync scheduling. Between
    # it and "vLLM chain k=3" lies what vLLM's full graphs and async scheduling give its chain.
    ("control: chain k=3, piecewise, sync", {"method": "draft_model", "num_speculative_tokens": 3}, ("1x3", "token")),
    # vLLM's chain with its own full graphs but sync scheduling: against "vLLM chain k=3", what async
    # scheduling gives a chain, the measured cost of method univer's refusing it (docs/gpu.md).
    ("control: chain k=3, sync", {"method": "draft_model", "num_speculative_tokens": 3}, ("1x3", "token")),
]
# Engine options of a row beyond its speculative config (merged into vLLM's defaults).
ROW_ENGINE_OPTIONS = {
    "control: chain k=3, piecewise, sync": {
        "async_scheduling": False,
        "compilation_config": {"cudagraph_mode": "PIECEWISE"},
    },
    "control: chain k=3, sync": {"async_scheduling": False},
}
ROW_BY_NAME = {row[0]: row for row in ROWS}
AUTO_WIDTHS = (1, 2)  # the width cuts of max_tree 2x5: its chain 1x5 and 2x5 itself
PROMPT_LEN = 128


def write_config(root: Path, shape: str) -> str:
    folder = root / shape
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**QWEN2, **SHAPES[shape]}, indent=1))
    return str(folder)


def study_tau(temperature: float = 1.0) -> dict[tuple[str, str], float]:
    """tau = 1 + mean expected accepted tokens, per (tree, method), from the acceptance study."""
    sums: dict[tuple[str, str], list[float]] = defaultdict(list)
    for line in STUDY.read_text().splitlines():
        r = json.loads(line)
        if r["temperature"] == temperature:
            sums[(r["tree"], r["method"])].append(r["accepted"])
    return {k: 1 + sum(v) / len(v) for k, v in sums.items()}


def cut_tau(tau: dict[tuple[str, str], float], cut: str, method: str) -> float:
    """tau of a cut of max_tree 2x5 ("WxD": width W, depth D; "0x0" no speculation) under
    ``method``: a chain is verified as Block Verification by every tree method."""
    width, depth = (int(v) for v in cut.split("x"))
    if depth == 0:
        return 1.0
    return tau[(cut, "block" if width == 1 else method)]


def auto_hazards(tau: dict[tuple[str, str], float], method: str) -> dict[str, list[float]]:
    """Per width of max_tree 2x5, the hazards h_d = P(A >= d) / P(A >= d - 1) that give the
    study's tau at every depth cut (P(A >= d) = tau(cut d) - tau(cut d - 1)), clipped to [0, 1]."""
    out = {}
    for width in AUTO_WIDTHS:
        taus = [cut_tau(tau, f"{width}x{d}", method) for d in range(6)]
        survival = [1.0] + [max(b - a, 0.0) for a, b in zip(taus, taus[1:])]
        out[str(width)] = [min(s / p, 1.0) if p > 0 else 0.0 for p, s in zip(survival, survival[1:])]
    return out


# ------------------------------------------------------------------ one engine
def _timers_on(worker, on: bool) -> dict:
    univer = getattr(worker.model_runner, "tree_speculation", None)
    if univer is None:
        return {}
    univer.timers.enabled = on
    return {**univer.timers.totals, **{f"calls:{k}": v for k, v in univer.timers.calls.items()}}


def _sizer_cuts(worker) -> dict:
    univer = getattr(worker.model_runner, "tree_speculation", None)
    sizer = getattr(univer, "sizer", None)
    return sizer.summary().get("requests_at_cut", {}) if sizer is not None else {}


def run_one_engine(job: dict) -> dict:
    import torch
    from vllm import LLM, SamplingParams

    from vllm_univer.tools.spec_counters import spec_counters

    spec = None if job["spec"] is None else {**job["spec"], "model": job["draft"]}
    options = dict(job.get("engine_options") or {})
    compilation = options.pop("compilation_config", {})
    if job.get("compile_backend"):
        compilation = {"backend": job["compile_backend"], **compilation}
    llm = LLM(
        model=job["target"],
        tokenizer=None,
        skip_tokenizer_init=True,
        load_format="dummy",
        speculative_config=spec,
        dtype="bfloat16" if torch.cuda.is_available() else "float32",
        enforce_eager=job["eager"],
        # Compilation backend "eager": vLLM's CUDA graphs and its own CUDA ops, without Inductor's
        # codegen (a cold Inductor compile took 120 s+ per engine on the H200).
        **({"compilation_config": compilation} if compilation else {}),
        **options,
        max_model_len=PROMPT_LEN + job["max_tokens"] + 256,
        max_num_seqs=max(job["batches"]),
        seed=0,
        disable_log_stats=False,
        # CPU smoke test: vLLM's CPU backend reserves this share of the host's memory.
        **({} if torch.cuda.is_available() else {"gpu_memory_utilization": 0.5}),
        **({"attention_backend": job["attention_backend"]} if job["attention_backend"] else {}),
    )
    gen = torch.Generator().manual_seed(0)
    vocab = json.loads((Path(job["target"]) / "config.json").read_text())["vocab_size"]

    def prompts(n):
        return [{"prompt_token_ids": torch.randint(3, vocab, (PROMPT_LEN,), generator=gen).tolist()} for _ in range(n)]

    def timed(batch, max_tokens):
        params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        before = spec_counters(llm)
        start = time.perf_counter()
        out = llm.generate(prompts(batch), params, use_tqdm=False)
        wall = time.perf_counter() - start
        after = spec_counters(llm)
        drafts = after.get("vllm:spec_decode_num_drafts", 0) - before.get("vllm:spec_decode_num_drafts", 0)
        accepted = after.get("vllm:spec_decode_num_accepted_tokens", 0) - before.get(
            "vllm:spec_decode_num_accepted_tokens", 0
        )
        return wall, sum(len(o.outputs[0].token_ids) for o in out), drafts, accepted

    timed(1, 4)  # warm-up
    auto = job["spec"] is not None and job["spec"].get("tree") == "auto"
    own_graphs = job["spec"] is not None and job["spec"].get("cuda_graphs") == "full"
    cells = []
    for batch in job["batches"]:
        m = job["max_tokens"]
        # Warm-up at this batch size: Triton specialises kernels on sizes (a multiple of 16,
        # 1), so a new batch size may compile kernels, which must not land in the timings.
        # With "cuda_graphs": "full" the package captures its own graphs (the draft levels',
        # the verification's) the first time a size is met: a warm-up as long as the timed
        # run meets the sizes of its tail too (requests finish at different steps).
        timed(batch, m if own_graphs else 4)
        wall_1, _, _, _ = timed(batch, 1)  # prefill and the first token
        cuts_before = llm.collective_rpc(_sizer_cuts)[0] if auto else {}
        wall_m, tokens, drafts, accepted = timed(batch, m)
        measured_tau = 1 + accepted / drafts if drafts else 1.0
        steps = max(tokens / batch / measured_tau - 1, 1.0)
        cell = {"batch": batch, "measured_tau": measured_tau}
        if auto:
            after = llm.collective_rpc(_sizer_cuts)[0]
            cell["requests_at_cut"] = {k: n - cuts_before.get(k, 0) for k, n in after.items()}
            # Plain steps count no drafts: the steps are the sizer's decisions, one per step and request.
            steps = max(sum(cell["requests_at_cut"].values()) / batch, 1.0)
        cell["step_ms"] = 1e3 * (wall_m - wall_1) / steps
        # The split, from a second run with the step timers on (they synchronise the device).
        before = llm.collective_rpc(_timers_on, args=(True,))[0]
        if before:
            timed(batch, m)
            after = llm.collective_rpc(_timers_on, args=(False,))[0]
            spent = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
            # tree auto: plain steps call no verify; every step counts.
            per_step = steps if auto else max(spent.get("calls:verify", 0), 1)
            cell["split_ms"] = {
                "verify": 1e3 * spent.get("verify", 0.0) / per_step,
                "draft forwards": 1e3 * spent.get("draft_forward", 0.0) / per_step,
                "drafter other": 1e3 * (spent.get("draft", 0.0) - spent.get("draft_forward", 0.0)) / per_step,
            }
        # At the goal's batch sizes only (a few seconds of profiling per cell).
        if torch.cuda.is_available() and batch in (min(job["batches"]), max(job["batches"])):
            try:
                cell["gpu_busy"] = decode_busy_share(lambda n: timed(batch, n), min(m, 24))
            except Exception as e:  # a diagnostic: the row keeps its timings without it
                cell["gpu_busy_error"] = repr(e)[:300]
        cells.append(cell)
    return {"cells": cells, "modes": engine_modes(llm.llm_engine.vllm_config)}


def decode_busy_share(generate, max_tokens: int, device: str = "cuda") -> float:
    """Share of decoding's wall time in which the GPU ran anything (kernels, copies):
    ``generate(n)`` (n tokens per request) profiled for ``max_tokens`` and for 1 token,
    the union of the device's activity intervals over the wall time, the two runs
    subtracted (prefill and the first token out). The profiler slows the host a little:
    a lower bound. 1 - share of a step is where the GPU waited for the host.
    (``device="cpu"``: the same over CPU ops, to check this code where there is no GPU.)"""
    import torch
    from torch.profiler import ProfilerActivity

    on_gpu = device == "cuda"
    activity = ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU
    device_type = torch.autograd.DeviceType.CUDA if on_gpu else torch.autograd.DeviceType.CPU
    kinds = {"kernel", "gpu_memcpy", "gpu_memset"} if on_gpu else {"cpu_op"}
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    busy, wall = [], []
    for n in (max_tokens, 1):
        sync()
        with torch.profiler.profile(activities=[activity]) as prof:
            start = time.perf_counter()
            generate(n)
            sync()
            wall.append(time.perf_counter() - start)
        busy.append(busy_seconds(prof, device_type, kinds))
    return (busy[0] - busy[1]) / max(wall[0] - wall[1], 1e-9)


def busy_seconds(prof, device_type, kinds: set[str]) -> float:
    """Length of the union of the intervals of ``prof``'s events on ``device_type`` of
    the activity ``kinds`` (GPU annotations would span the gaps between kernels)."""
    spans = sorted(
        (e.start_ns(), e.end_ns())
        for e in prof.profiler.kineto_results.events()
        if e.device_type() == device_type and e.activity_type() in kinds
    )
    total, reach = 0, None
    for start, end in spans:
        if reach is None or start > reach:
            total, reach = total + end - start, end
        elif end > reach:
            total, reach = total + end - reach, end
    return total / 1e9


def engine_modes(config) -> str:
    """How vLLM resolved this engine: its CUDA-graph mode and whether it schedules
    asynchronously. vLLM's defaults differ by row: its own draft_model chain and no
    speculation get FULL_AND_PIECEWISE graphs and async scheduling on a GPU, where
    method "univer" runs PIECEWISE (tree attention outside the graphs) and synchronous
    scheduling (trees are drafted from the committed tokens)."""
    graphs = config.compilation_config.cudagraph_mode
    scheduling = "async" if config.scheduler_config.async_scheduling else "sync"
    return f"{getattr(graphs, 'name', graphs)}, {scheduling}"


# ------------------------------------------------------------------ the matrix
def run(args, save) -> list[dict]:
    """Every (pair, row) engine in turn; ``save(results)`` after each, so a run stopped
    from outside keeps what it measured. Rows not started before ``args.deadline``
    seconds are listed as skipped. Should the first engine fail under CUDA graphs,
    that row and every later one run eager (``enforce_eager``), and the report says so;
    one that ran out of time (a cold compile) is reported as failed and the rest keep graphs."""
    root = Path(args.work)
    results = []
    tau = study_tau()
    start_all = time.perf_counter()
    rows = [ROW_BY_NAME[n] for n in args.rows] if args.rows else ROWS
    for pair in args.pairs:
        target_shape, draft_shape = PAIRS[pair]
        target, draft = write_config(root, target_shape), write_config(root, draft_shape)
        for name, spec, study in rows:
            row = {"pair": pair, "name": name, "study": study}
            if args.deadline and time.perf_counter() - start_all > args.deadline:
                results.append({**row, "error": f"skipped: past the {args.deadline:.0f} s deadline"})
                continue
            env = {**os.environ, **ENV}
            if study and study[0] == "auto":
                env[FIXED_HAZARDS_ENV] = json.dumps(auto_hazards(tau, study[1]))
            job = {
                "spec": spec,
                "target": target,
                "draft": draft,
                "batches": args.batches,
                "max_tokens": args.max_tokens,
                "eager": args.eager,
                "attention_backend": args.attention_backend,
                "compile_backend": args.compile_backend,
                "engine_options": ROW_ENGINE_OPTIONS.get(name),
            }
            print(f"[gpu_engine] {pair} {name}{' (eager)' if args.eager else ''} ...", flush=True)
            start = time.perf_counter()
            result, stderr = run_json_job(
                ["-m", "benchmarks.gpu_engine", "--one"], job, env, timeout=args.engine_timeout
            )
            # A first engine that fails under CUDA graphs (not one that ran out of time compiling)
            # would fail every row alike: the rest run eager.
            if result is None and not args.eager and not results and TIMED_OUT not in stderr:
                print(f"[gpu_engine] failed under CUDA graphs, every row now eager:\n{stderr[-3000:]}", flush=True)
                args.eager = True
                args.graphs_error = stderr[-1500:]
                job["eager"] = True
                result, stderr = run_json_job(
                    ["-m", "benchmarks.gpu_engine", "--one"], job, env, timeout=args.engine_timeout
                )
            row.update(engine_s=time.perf_counter() - start, eager=args.eager)
            if result is None:
                row["error"] = stderr[-3000:]
                print(row["error"], flush=True)
            else:
                row.update(result)
                print(json.dumps(row["cells"]), flush=True)
            results.append(row)
            save(results)
    return results


def report(results: list[dict], command: str, device: str) -> str:
    tau = study_tau()
    lines = [
        "# Tree speculation on a GPU: step time and projected tokens/s",
        "",
        f"Command: `{command}`. Device: {device}. Random weights in real shapes (`load_format=dummy`), "
        f"prompts of {PROMPT_LEN} random tokens, T = 1. Step time: decode only (generate M tokens minus 1 token, "
        "over the steps between). tau: the acceptance study on the real Qwen 1.5B / 0.5B pair "
        "(`results/acceptance.jsonl`, same verifier and shape, T = 1), not measured here. Projected tokens/s = "
        "batch x tau / step time; ratios within a pair and batch, all rows from this run. "
        "Split: the package's step timers in a second run (they synchronise the device): "
        "verify (target probabilities, verifier, KV moves), draft forwards, drafter other (its own bookkeeping). "
        "`auto` rows: tree auto (max_tree 2x5) choosing on this machine's measured costs with the study's "
        "acceptance as fixed hazards (`VLLM_UNIVER_AUTO_HAZARDS`; random weights accept nothing); their tau is the "
        "study's tau of each cut they drafted (chains: Block Verification), averaged over request-steps (listed "
        "under the table: WxD = width W, depth D; 0x0 = no speculation). Graphs, scheduling: the CUDA-graph mode "
        "and scheduling vLLM resolved for the row's engine (its defaults give its own rows full graphs for uniform "
        "decode steps and async scheduling on a GPU; method univer runs piecewise graphs and sync scheduling). "
        "GPU busy (smallest and largest batch): the share of decoding's wall time in which the GPU ran anything "
        "(torch.profiler, 24 tokens, prefill subtracted; a lower bound): the rest of a step the GPU waited for "
        "the host.",
        "",
        "| pair | row | batch | step ms | verify ms | draft fwd ms | drafter other ms | package share | tau (study) "
        "| proj. tok/s | vs no spec | vs best chain | GPU busy | graphs, scheduling |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_cell: dict[tuple[str, int], dict[str, float]] = defaultdict(dict)
    shares: dict[tuple[str, str, int], float] = {}
    for row in results:
        for cell in row.get("cells", []):
            if "requests_at_cut" in cell:  # tree auto: the study's tau over the cuts it drafted
                counts = cell["requests_at_cut"]
                t = sum(n * cut_tau(tau, cut, row["study"][1]) for cut, n in counts.items()) / max(
                    sum(counts.values()), 1
                )
            else:
                t = tau[row["study"]] if row["study"] else 1.0
            cell["tau"], cell["projected"] = t, cell["batch"] * t / (cell["step_ms"] / 1e3)
            by_cell[(row["pair"], cell["batch"])][row["name"]] = cell["projected"]
            if "split_ms" in cell:
                split = cell["split_ms"]
                shares[(row["pair"], row["name"], cell["batch"])] = (split["verify"] + split["drafter other"]) / cell[
                    "step_ms"
                ]
    for row in results:
        if "error" in row:
            what = row["error"] if row["error"].startswith("skipped") else "failed: see the JSON"
            lines.append(f"| {row['pair']} | {row['name']} | - | {what} | | | | | | | | | | |")
            continue
        for cell in row["cells"]:
            rates = by_cell[(row["pair"], cell["batch"])]
            chains = [v for k, v in rates.items() if k.startswith("vLLM chain")]
            plain = rates.get("no speculation")
            split = cell.get("split_ms", {})
            share = shares.get((row["pair"], row["name"], cell["batch"]))
            columns = [row["pair"], row["name"], cell["batch"], f"{cell['step_ms']:.2f}"]
            columns += [f"{split[k]:.2f}" if k in split else "-" for k in ("verify", "draft forwards", "drafter other")]
            columns += [f"{100 * share:.1f} %" if share is not None else "-", f"{cell['tau']:.2f}"]
            columns += [f"{cell['projected']:.1f}"]
            columns += [f"{cell['projected'] / plain:.2f}x" if plain else "-"]
            columns += [f"{cell['projected'] / max(chains):.2f}x" if chains else "-"]
            columns += [f"{100 * cell['gpu_busy']:.0f} %" if "gpu_busy" in cell else "-", row.get("modes", "-")]
            lines.append("| " + " | ".join(str(c) for c in columns) + " |")
    for row in results:
        for cell in row.get("cells", []):
            if "requests_at_cut" in cell:
                counts = cell["requests_at_cut"]
                total = max(sum(counts.values()), 1)
                drafted = ", ".join(f"{cut}: {100 * n / total:.0f} %" for cut, n in sorted(counts.items()) if n)
                lines.append(f"- {row['pair']} {row['name']}, batch {cell['batch']}: cuts drafted {drafted}")
    lines += ["", goal_line(results, by_cell, shares)]
    return "\n".join(lines) + "\n"


def goal_line(results, by_cell, shares) -> str:
    """univer (best shape per batch) / vLLM's chain (best k), and univer's package share, at batch 1 and 32."""
    pair = results[0]["pair"] if results else "-"
    parts, share_parts = [], []
    for batch in (1, 32):
        rates = by_cell.get((pair, batch), {})
        univer = {k: v for k, v in rates.items() if k.startswith("univer")}
        chains = [v for k, v in rates.items() if k.startswith("vLLM chain")]
        if univer and chains:
            best = max(univer, key=univer.get)
            parts.append(f"batch {batch} = {univer[best] / max(chains):.2f}x")
            share = shares.get((pair, best, batch))
            share_parts.append(f"batch {batch} = {100 * share:.0f} %" if share is not None else f"batch {batch} = -")
        else:
            parts.append(f"batch {batch} = -")
            share_parts.append(f"batch {batch} = -")
    return f"GOAL univer/chain tokens/s: {', '.join(parts)}; package share of step: {', '.join(share_parts)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", nargs="+", default=["7b"], choices=sorted(PAIRS))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--eager", action="store_true", help="enforce_eager (default: vLLM's piecewise CUDA graphs)")
    ap.add_argument("--attention-backend", default=None, help="e.g. TRITON_ATTN or FLASH_ATTN (default: vLLM's)")
    ap.add_argument(
        "--compile-backend",
        default=None,
        choices=["inductor", "eager"],
        help="vLLM's compilation backend under CUDA graphs (default: vLLM's, inductor); eager keeps the piecewise "
        "CUDA graphs and vLLM's CUDA ops and starts an engine in seconds instead of minutes from a cold cache",
    )
    ap.add_argument("--engine-timeout", type=float, default=300)
    ap.add_argument("--work", default="/tmp/vllm-univer-gpu-engine", help="where the config folders go")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--stem", default="gpu_engine", help="result file names: STEM.md, STEM.json")
    ap.add_argument("--deadline", type=float, default=None, help="start no engine after this many seconds")
    ap.add_argument(
        "--rows", nargs="+", default=None, metavar="NAME", help="only these rows, in this order (default: all)"
    )
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if unknown := set(args.rows or ()) - ROW_BY_NAME.keys():
        ap.error(f"unknown rows {sorted(unknown)}; rows: {list(ROW_BY_NAME)}")
    if args.one:
        print_result(run_one_engine(json.load(sys.stdin)))
        return
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (smoke test; not the benchmark)"
    command = "python -m benchmarks.gpu_engine " + " ".join(sys.argv[1:])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.stem if torch.cuda.is_available() else f"{args.stem}_cpu_smoke"
    args.graphs_error = None

    def save(results: list[dict]) -> str:
        mode = "enforce_eager" if args.eager else "vLLM's CUDA graphs (each row's mode in the table)"
        if not args.eager and args.compile_backend:
            mode += f", compilation backend {args.compile_backend}"
        if args.graphs_error:
            mode += " (CUDA graphs failed on the first engine; see the JSON)"
        text = report(results, command.strip(), f"{device}; {mode}")
        data = {"command": command, "device": device, "graphs_error": args.graphs_error, "rows": results}
        (out / f"{stem}.json").write_text(json.dumps(data, indent=1))
        (out / f"{stem}.md").write_text(text)
        return text

    print(save(run(args, save)))


if __name__ == "__main__":
    main()
