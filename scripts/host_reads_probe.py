"""Which host reads of step results remain in an engine step of method univer?

Runs a tiny target/draft pair (``tests/tiny_models.py``) through vLLM on this
machine with ``tools/host_reads.HostReadGuard`` around the tree verifier (taint:
the target logits it is given) and the drafter (taint: the sampled tokens), and
lists every host read of a tainted value with the functions it came from: on a
GPU each is a wait for the device (reads after the drafter's launch are marked).

    python scripts/host_reads_probe.py --tree 2x3 --temperature 1
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the hooks live in this process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", default="2x3", help="a shape, or 'dynamic' (8 nodes, expand 2, m 2)")
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args()

    from tiny_models import build_perturbed_draft, build_tiny_llama
    from vllm import LLM, SamplingParams

    from vllm_univer.tools.host_reads import HostReadGuard

    folder = Path(tempfile.mkdtemp(prefix="host_reads_"))
    target = build_tiny_llama(folder / "target", vocab_size=512, seed=0, logit_scale=8.0)
    draft = build_perturbed_draft(target, folder / "draft", noise=0.5)
    spec = {"method": "univer", "model": str(draft), "tree": args.tree}
    if args.tree == "dynamic":
        spec.update(max_nodes=8, max_depth=4, expand=2, max_children=2)
    llm = LLM(
        model=str(target),
        speculative_config=spec,
        dtype="float32",
        enforce_eager=True,
        block_size=32,
        seed=0,
        max_model_len=1024,
        gpu_memory_utilization=0.1,
    )
    reads: collections.Counter = collections.Counter()
    steps: collections.Counter = collections.Counter()

    class Recorder(HostReadGuard):
        label = ""

        def _read(self, what, tensor):
            if self.is_tainted(tensor):
                frames = [f.name for f in traceback.extract_stack()[:-2] if "vllm" in f.filename]
                reads[(self.label, what, " > ".join(frames[-4:]))] += 1

    def install(worker) -> None:
        runner = worker.model_runner
        univer = runner.tree_speculation
        verify, propose = runner.rejection_sampler, univer.drafter.propose

        def recorded_verify(metadata, draft_probs, logits, sampling_metadata):
            steps["verify"] += 1
            with Recorder([logits]) as guard:
                guard.label = "verify"
                return verify(metadata, draft_probs, logits, sampling_metadata)

        def recorded_propose(sampled, sampling_metadata, depth=None, tree=None, launched=None):
            steps["draft"] += 1
            with Recorder([sampled]) as guard:
                guard.label = "draft"

                def after_launch() -> None:
                    guard.label = "draft, after launch"
                    if launched is not None:
                        launched()

                return propose(sampled, sampling_metadata, depth, tree, after_launch)

        runner.rejection_sampler, univer.drafter.propose = recorded_verify, recorded_propose

    llm.collective_rpc(install)
    rng = random.Random(1)
    words = "the a of and to in is it you that he was for on are with as his they be at one have".split()
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 40))) for _ in range(4)]
    params = SamplingParams(temperature=args.temperature, max_tokens=40, ignore_eos=True)
    llm.generate(prompts, [params] * len(prompts), use_tqdm=False)
    print(f"tree {args.tree}, T = {args.temperature}: {dict(steps)} calls")
    print("| reads | where | read | from |\n|---|---|---|---|")
    for (label, what, where), n in sorted(reads.items()):
        print(f"| {n} | {label} | {what} | {where} |")


if __name__ == "__main__":
    main()
