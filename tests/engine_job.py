"""Run vLLM engines in a fresh process and print what they generate, as JSON.

Tests start this in a subprocess (``run_engines``) so every engine gets a clean
process: vLLM keeps global state, and a failed engine must not leak into the
next test. Engines run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), one
after another.

Job (stdin): {"engines": [{"kwargs": {...LLM kwargs}, "calls": [{"prompts": [...],
"params": [{...SamplingParams kwargs}, ...]}], "margins": bool, "sizer": bool, "rank_decisions": bool,
"draft_padding": int, "blind_drafting": bool, "run_every_node": bool, "tree_kinds": bool,
"draft_graphs": "emulate" | "report", "verify_graphs": "emulate" | "report", "target_graphs": bool}]}.
A prompt is a string or a list of token ids. Result (the last stdout line, after ``RESULT``): per
engine {"error": str} or {"calls": [{"outputs": [[token ids], ...], "logprobs": [[{token: logprob}]]
per output, when asked for, "margins" and "top2" with ``margins``} | {"error": str, "traceback":
str}], "spec": {counter: value}, and with the options:

- "rank_decisions": [{"steps", "digest", "level0_tokens", "draft_rows"}] per worker (level0_tokens:
  per step, the tokens the draft's level 0 ran and the requests drafted; draft_rows: per step, the
  tokens its deeper levels ran);
- "padded_forwards": int with ``draft_padding`` (every draft forward padded to a multiple of it, as
  for a CUDA-graph replay);
- "blind_drafts": {"steps", "exempt_reads"} with ``blind_drafting`` (steps that drafted trees while
  every host read of the sampled tokens raised, and the reads let through);
- "draft_graphs" with ``draft_graphs``: {"replays", "sizes"}: the drafter's level forwards replayed from
  ``DraftLevelGraphs`` (``"cuda_graphs": "full"`` on CUDA); with ``"draft_graphs": "emulate"`` attached on
  any device, each graph a rerun checked by ``GraphDiscipline``: also "runs", "violations", "unstable_inputs";
- "verify_graphs" with ``verify_graphs`` ("report" | "emulate" as above): {"replays", "sizes"} (and with
  "emulate" "runs", "violations", "unstable_inputs"): sampled steps' verification replayed from ``VerifyGraphs``;
- "target_graphs" with ``"target_graphs": true``: {query tokens per request: forwards}, the target's
  forwards of real batches under a full CUDA graph (``"cuda_graphs": "full"`` on CUDA);
- "catch_up_chunks" with ``catch_up_chunks``: the draft's catch-up chunks run (``TreeDrafter._catch_up``);
- ``run_every_node``: the dynamic drafter runs every node of its levels (no result of its own);
- "tree_kinds" in each call's result with ``tree_kinds``: {"static": steps, "dynamic": steps}, the
  call's steps that drafted one shape for the batch or per-request trees (``LevelLayout``)}.

An engine with ``"margins": true`` is a greedy reference: it samples from
processed logprobs (``logprobs_mode="processed_logprobs"``: after penalties,
biases and masks, what the argmax is taken of) and returns each position's
top-1 minus top-2 logprob and those two tokens, for ``greedy_identity``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback

from vllm_univer.tools.json_job import print_result, run_json_job

ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "TOKENIZERS_PARALLELISM": "false",
}
BASE_KWARGS = {"dtype": "float32", "enforce_eager": True, "block_size": 32, "seed": 0, "disable_log_stats": False}
# vLLM's piecewise CUDA graphs for target and draft, without Inductor's codegen (engines start fast).
CUDA_GRAPHS = {"enforce_eager": False, "compilation_config": {"backend": "eager"}}
# On a GPU machine, scripts/gpu_engine_check.sh reruns the engine tests per attention backend,
# and under CUDA graphs.
if os.environ.get("UNIVER_TEST_ATTENTION_BACKEND"):
    BASE_KWARGS["attention_backend"] = os.environ["UNIVER_TEST_ATTENTION_BACKEND"]
if os.environ.get("UNIVER_TEST_CUDA_GRAPHS") == "1":
    BASE_KWARGS.update(CUDA_GRAPHS)


def run_engines(engines: list[dict], timeout: float = 1200, env: dict | None = None) -> list[dict]:
    """Run ``engines`` (see the module docstring) in a subprocess, with ``env``
    added to its environment; return their results."""
    result, stderr = run_json_job([__file__], {"engines": engines}, {**os.environ, **ENV, **(env or {})}, timeout)
    if result is None:
        raise RuntimeError(f"engine job failed:\n{stderr[-6000:]}")
    for engine in result:
        engine["calls"] = [Call(c, stderr) for c in engine.get("calls", [])]
    return result


class Call(dict):
    """One call's result; reading a key a failed call lacks (its "outputs") fails
    with the call's error and the engine job's stderr tail (the worker's traceback)."""

    def __init__(self, result: dict, stderr: str):
        super().__init__(result)
        self._stderr = stderr

    def __missing__(self, key):
        if "error" not in self:
            raise KeyError(key)
        tail = self._stderr[-8000:]
        raise AssertionError(
            f"the call failed: {self.get('traceback', self['error'])}\n--- engine job stderr (tail) ---\n{tail}"
        )


def _prompt(p):
    return {"prompt_token_ids": p} if isinstance(p, list) else p


def _op_counts(worker, clear: bool = False) -> dict:
    """The package's op counts per section so far (``VLLM_UNIVER_OP_COUNTS=1``); with
    ``clear``, counting starts again from zero."""
    univer = getattr(worker.model_runner, "tree_speculation", None)
    if univer is None:
        return {}
    counts = univer.timers.op_counts()
    if clear:
        univer.timers.ops.sections.clear()
        univer.timers.calls.clear()
    return counts


def _catch_up_chunks(worker) -> int:
    return worker.model_runner.tree_speculation.drafter.catch_up_chunks


def _sizer_summary(worker) -> dict:
    univer = getattr(worker.model_runner, "tree_speculation", None)
    return univer.sizer.summary() if univer is not None and univer.sizer is not None else {}


def _record_decisions(worker) -> None:
    """Keep, on this worker, every tree it drafts and every verification outcome."""
    runner = worker.model_runner
    univer = runner.tree_speculation
    univer.decisions = decisions = []
    propose, verify = univer.drafter.propose, runner.rejection_sampler
    univer.level0_tokens = level0 = []
    univer.draft_rows = rows = []

    def recorded_propose(*args, **kwargs):
        drafts = propose(*args, **kwargs)
        decisions.append(("draft", drafts))
        if univer.drafter.forward_tokens:  # (tokens the draft's level 0 ran, requests drafted)
            level0.append((univer.drafter.forward_tokens[0], sum(len(d) > 0 for d in drafts)))
            rows.append(sum(univer.drafter.forward_tokens[1:]))  # the deeper levels' query tokens
        return drafts

    def recorded_verify(*args, **kwargs):
        output = verify(*args, **kwargs)
        decisions.append(("verify", output.sampled_token_ids.tolist()))
        return output

    univer.drafter.propose, runner.rejection_sampler = recorded_propose, recorded_verify


def _pad_draft_forwards(worker, multiple: int) -> None:
    """Make every draft forward of this worker's tree drafter take the path of a
    CUDA-graph replay (inputs in the proposer's buffers, padded to a multiple of
    ``multiple`` tokens), eagerly; count the padded forwards."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor

    proposer = worker.model_runner.tree_speculation.drafter.proposer
    proposer.padded_forwards = 0

    def dispatch(num_tokens, *args, **kwargs):
        padded = -(-num_tokens // multiple) * multiple
        proposer.padded_forwards += padded > num_tokens
        return CUDAGraphMode.NONE, BatchDescriptor(num_tokens=padded)

    proposer.cudagraph_dispatcher.dispatch = dispatch


def _padded_forwards(worker) -> int:
    return worker.model_runner.tree_speculation.drafter.proposer.padded_forwards


def _blind_drafting(worker) -> None:
    """Make a host read of anything computed from a step's sampled tokens an error in
    this worker's drafter until its forwards are launched (``launched``; a
    ``HostReadGuard`` follows the tokens through every op, in-place writes included),
    and so the verifier's deferred results (``settle``); count the steps that drafted
    trees so guarded."""
    import torch

    from vllm_univer.tools.host_reads import HostReadGuard, TaintedHostRead

    univer = worker.model_runner.tree_speculation
    drafter, propose, settle = univer.drafter, univer.drafter.propose, univer.sampler.settle
    univer.blind_drafts = univer.exempt_reads = 0
    guard = None

    def guarded_settle() -> None:
        if guard is not None and guard.armed:
            raise TaintedHostRead("the verifier's results were read before the draft forwards were launched")
        settle()

    def blind_propose(sampled_token_ids, sampling_metadata, depth=None, tree=None, launched=None, catch_up=None):
        nonlocal guard

        def seen() -> None:
            guard.disarm()
            if launched is not None:
                launched()

        sources = [sampled_token_ids] if torch.is_tensor(sampled_token_ids) else []
        try:
            # top_tokens' check for ties across the k-th token (k >= 2) reads the tensor on a
            # CPU only (free there); on a GPU, top_tokens and the drafters' draws are Triton kernels.
            with HostReadGuard(sources, exempt=("top_tokens",)) as guard:
                drafts = propose(sampled_token_ids, sampling_metadata, depth, tree, seen, catch_up)
            univer.exempt_reads += guard.exempt_reads
        finally:
            guard = None
        univer.blind_drafts += any(drafts)
        return drafts

    drafter.propose, univer.sampler.settle = blind_propose, guarded_settle


def checked_capture(checks: dict, constant_fills: bool = False):
    """A graph's stand-in (``rerun_capture``) whose every run of the region after the
    warm-up is checked by ``GraphDiscipline``: what capture would break on, and whether
    the region reads the same storages every time (counted in ``checks``)."""
    from vllm_univer.integration.draft_level_graphs import rerun_capture
    from vllm_univer.tools.graph_discipline import GraphDiscipline

    checks.update(runs=0, violations=[], unstable_inputs=0)

    def capture(fn):
        first_inputs = []

        warm = []

        def checked():
            if not warm:  # the warm-up run (outside any capture on CUDA: first calls fill caches)
                warm.append(True)
                return fn()
            with GraphDiscipline(allow_allocations=True, constant_fills=constant_fills) as region:
                output = fn()
            checks["runs"] += 1
            checks["violations"] += sorted(set(region.violations) - set(checks["violations"]))
            if not first_inputs:
                first_inputs.append(region.inputs)
            checks["unstable_inputs"] += region.inputs != first_inputs[0]
            return output

        return rerun_capture(checked)

    return capture


def _draft_graphs(worker) -> None:
    """Make this worker's drafter replay its uniform level forwards from
    ``DraftLevelGraphs`` (as ``"cuda_graphs": "full"`` does on CUDA), each graph
    checked by ``checked_capture``."""
    univer = worker.model_runner.tree_speculation
    univer.graph_checks = {}
    univer.use_draft_level_graphs(checked_capture(univer.graph_checks))


def _verify_graphs(worker) -> None:
    """Make this worker's sampler replay sampled steps' verification from
    ``VerifyGraphs`` (as ``"cuda_graphs": "full"`` does on CUDA), each graph checked
    by ``checked_capture``."""
    univer = worker.model_runner.tree_speculation
    univer.verify_graph_checks = {}
    # The region's host values (the tree's sizes, literals) are fixed per graph.
    univer.use_verify_graphs(checked_capture(univer.verify_graph_checks, constant_fills=True))


def _target_graphs(worker) -> None:
    """Make this worker's runner dispatch uniform batches as under vLLM's
    FULL_DECODE_ONLY CUDA graphs (as ``"cuda_graphs": "full"`` does on CUDA, where
    the mode is FULL_AND_PIECEWISE): vLLM's keys for whole trees and, with
    ``tree: auto``, this package's for each cut's length (``full_graph_lengths``).
    Nothing is captured on CPU: such a forward runs eagerly but as a replay would,
    padded to the graph's batch size, its attention metadata padded, the tree rows
    planned in the graph's buffers (``TreeGraphPlans``). Mixed batches run as
    before (no piecewise graphs on CPU)."""
    from vllm.config import CUDAGraphMode

    runner = worker.model_runner
    main = runner.uniform_decode_query_len
    compilation = runner.compilation_config
    compilation.cudagraph_capture_sizes = [main * b for b in range(1, runner.scheduler_config.max_num_seqs + 1)]
    compilation.max_cudagraph_capture_size = compilation.cudagraph_capture_sizes[-1]
    runner.tree_speculation.use_full_graph_plans()  # the plans, and auto's lengths on the dispatcher
    runner.cudagraph_dispatcher.initialize_cudagraph_keys(CUDAGraphMode.FULL_DECODE_ONLY, main)


def _verify_graph_checks(worker) -> dict:
    univer = worker.model_runner.tree_speculation
    graphs = univer.sampler.verify_graphs
    if graphs is None:
        return {"replays": 0, "sizes": 0}
    checks = getattr(univer, "verify_graph_checks", {})  # "emulate" only
    return {**checks, "replays": graphs.replays, "sizes": len(graphs.graphs)}


def _target_graph_forwards(worker) -> dict:
    """{query tokens per request: the target's forwards of real batches under a full
    CUDA graph} (vLLM's own for whole trees, this package's for ``tree: auto``'s cuts)."""
    forwards = worker.model_runner.tree_speculation.full_graph_forwards
    return {str(length): count for length, count in sorted(forwards.items())}


def _draft_graph_checks(worker) -> dict:
    univer = worker.model_runner.tree_speculation
    graphs = univer.drafter.level_graphs
    if graphs is None:
        return {"replays": 0, "sizes": []}
    sizes = sorted([list(key) for key in graphs.graphs])
    return {**getattr(univer, "graph_checks", {}), "replays": graphs.replays, "sizes": sizes}


def _run_every_node(worker) -> None:
    """Make this worker's dynamic drafter run every node of each level, not only those it expands."""
    worker.model_runner.tree_speculation.drafter._nodes_to_run = lambda scores: None


def _count_tree_kinds(worker) -> None:
    """Count, on this worker, the steps that draft one static shape and those that draft per-request trees."""
    from vllm_univer.core.tree_batch import LevelLayout

    univer = worker.model_runner.tree_speculation
    univer.tree_kinds = kinds = {"static": 0, "dynamic": 0}
    propose = univer.drafter.propose

    def counted_propose(*args, **kwargs):
        drafts = propose(*args, **kwargs)
        if any(drafts):
            kinds["dynamic" if isinstance(univer.state.latest_tree, LevelLayout) else "static"] += 1
        return drafts

    univer.drafter.propose = counted_propose


def _take_tree_kinds(worker) -> dict:
    kinds = worker.model_runner.tree_speculation.tree_kinds
    taken = dict(kinds)
    kinds.update(static=0, dynamic=0)
    return taken


def _blind_drafts(worker) -> dict:
    univer = worker.model_runner.tree_speculation
    return {"steps": univer.blind_drafts, "exempt_reads": univer.exempt_reads}


def _decisions_digest(worker) -> dict:
    """How many drafting and verification steps this worker recorded, and a digest of them all."""
    import hashlib

    univer = worker.model_runner.tree_speculation
    digest = hashlib.sha256(repr(univer.decisions).encode()).hexdigest()
    return {
        "steps": len(univer.decisions),
        "digest": digest,
        "level0_tokens": univer.level0_tokens,
        "draft_rows": univer.draft_rows,
    }


def _sampling_params(kwargs: dict):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    if "structured_outputs" in kwargs:
        kwargs = {**kwargs, "structured_outputs": StructuredOutputsParams(**kwargs["structured_outputs"])}
    if "logit_bias" in kwargs:  # JSON object keys are strings
        kwargs = {**kwargs, "logit_bias": {int(t): b for t, b in kwargs["logit_bias"].items()}}
    return SamplingParams(**kwargs)


def _run_engine(engine: dict) -> dict:
    from greedy_identity import top2_from_logprobs
    from vllm import LLM

    from vllm_univer.tools.spec_counters import spec_counters

    margins = engine.get("margins", False)
    kwargs = {**BASE_KWARGS, **engine["kwargs"]}
    if margins:
        kwargs["logprobs_mode"] = "processed_logprobs"
    try:
        llm = LLM(**kwargs)
    except Exception as exc:  # noqa: BLE001 - the error message is the result
        return {"error": f"{type(exc).__name__}: {exc}"}
    if engine.get("rank_decisions"):  # every worker's drafts and outcomes, to compare across ranks
        llm.collective_rpc(_record_decisions)
    if engine.get("draft_padding"):
        llm.collective_rpc(_pad_draft_forwards, args=(engine["draft_padding"],))
    if engine.get("blind_drafting"):
        llm.collective_rpc(_blind_drafting)
    if engine.get("run_every_node"):
        llm.collective_rpc(_run_every_node)
    if engine.get("tree_kinds"):
        llm.collective_rpc(_count_tree_kinds)
    if engine.get("draft_graphs") == "emulate":
        llm.collective_rpc(_draft_graphs)
    if engine.get("verify_graphs") == "emulate":
        llm.collective_rpc(_verify_graphs)
    if engine.get("target_graphs") == "emulate":
        llm.collective_rpc(_target_graphs)
    calls = []
    for call in engine["calls"]:
        try:
            asked = [p.get("logprobs") for p in call["params"]]
            params = [
                _sampling_params({**p, "logprobs": max(p.get("logprobs") or 0, 2)} if margins else p)
                for p in call["params"]
            ]
            out = llm.generate([_prompt(p) for p in call["prompts"]], params, use_tqdm=False)
            entry = {"outputs": [list(o.outputs[0].token_ids) for o in out]}
            logprobs = [
                [{str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs or []] for o in out
            ]
            if margins:
                tops = [
                    top2_from_logprobs([{int(t): lp for t, lp in step.items()} for step in steps]) for steps in logprobs
                ]
                entry["margins"], entry["top2"] = [m for m, _ in tops], [t for _, t in tops]
            if any(a is not None for a in asked):
                entry["logprobs"] = logprobs
            if engine.get("tree_kinds"):
                entry["tree_kinds"] = llm.collective_rpc(_take_tree_kinds)[0]
            calls.append(entry)
        except Exception as exc:  # noqa: BLE001 - the error and where it came from are the result
            calls.append({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
    result = {"calls": calls, "spec": spec_counters(llm, ("vllm:spec_decode", "vllm:num_preemptions", "vllm:univer"))}
    if engine.get("rank_decisions"):
        result["rank_decisions"] = llm.collective_rpc(_decisions_digest)
    if engine.get("draft_padding"):
        result["padded_forwards"] = llm.collective_rpc(_padded_forwards)[0]
    if engine.get("draft_graphs"):
        result["draft_graphs"] = llm.collective_rpc(_draft_graph_checks)[0]
    if engine.get("verify_graphs"):
        result["verify_graphs"] = llm.collective_rpc(_verify_graph_checks)[0]
    if engine.get("target_graphs"):
        result["target_graphs"] = llm.collective_rpc(_target_graph_forwards)[0]
    if engine.get("blind_drafting"):
        result["blind_drafts"] = llm.collective_rpc(_blind_drafts)[0]
    if engine.get("sizer"):  # tree "auto": the depths it chose and what it learnt
        result["sizer"] = llm.collective_rpc(_sizer_summary)[0]
    if engine.get("catch_up_chunks"):
        result["catch_up_chunks"] = llm.collective_rpc(_catch_up_chunks)[0]
    if os.environ.get("VLLM_UNIVER_OP_COUNTS") == "1":  # set by the test that wants them
        result["op_counts"] = llm.collective_rpc(_op_counts)[0]
    del llm
    gc.collect()
    return result


def main() -> None:
    job = json.load(sys.stdin)
    results = []
    for engine in job["engines"]:
        try:
            results.append(_run_engine(engine))
        except Exception:  # noqa: BLE001
            results.append({"error": traceback.format_exc()})
    print_result(results)


if __name__ == "__main__":
    main()
