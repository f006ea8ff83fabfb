"""Host time of ``tree: "auto"``'s choice per step (``TreeChooser.choose``).

The choice runs on the host between the verifier and the drafter, once per
engine step, with the device idle: on an H200 a 7B decode step takes about 7 ms,
so every 0.1 ms of choice is about 1.4 % of the step. This times the choice on
the sizer's own models as served: ``max_tree`` 2x5 and its chain (the two
shapes ``auto`` switches among), forward costs shaped like an H200's (flat up
to a few hundred rows), acceptance and costs learning from every step (what a
serving engine does between two choices; timed apart), each request with an
acceptance of its own (so requests form groups with depths of their own), for
a batch of one temperature band and for a batch mixing all four (every mix of
group depths priced, or coordinate ascent: ``tree_choice.EXHAUSTIVE_MIXES``),
side by side in one run. A priced choice is kept for a few decisions of the
same batch (``tree_choice.REPRICE_EVERY``): the mean per step, and apart the
mean of the steps that priced.

    python -m benchmarks.sizer_overhead
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from vllm_univer.core.tree import TreeSpec
from vllm_univer.sizing import (
    AcceptanceModel,
    ForwardCost,
    ShapeModels,
    StepCostModel,
    TreeChooser,
    children_per_node,
    prior_hazards,
    tree_choice,
)

RESULTS = Path(__file__).parent / "results"
STEP_MS_H200_7B = 7.0  # a Qwen2.5-7B decode step on one H200, for scale (issue 12)


def serving_chooser(max_tree: str, draft_pays: bool = True) -> TreeChooser:
    """The sizer's chooser: ``max_tree`` and its chain, forwards flat to 256 rows, then
    linear (memory-bound decode on a large GPU); the draft a sixth of the target, or
    (``draft_pays`` False) as slow as the target: no cut pays, every step is plain."""
    tree = TreeSpec.parse(max_tree)
    shapes = [tree.width_cut(1), tree]
    target = ForwardCost([1, 256, 4096], [7e-3, 7.4e-3, 60e-3])
    draft = ForwardCost([1, 256, 4096], [1.2e-3, 1.3e-3, 6e-3]) if draft_pays else target
    return TreeChooser(
        [
            ShapeModels(
                StepCostModel(target, draft, s.nodes_per_depth),
                AcceptanceModel(
                    s.max_depth, prior_hazards(s.nodes_per_depth), children=children_per_node(s.nodes_per_depth)
                ),
            )
            for s in shapes
        ]
    )


def time_steps(chooser: TreeChooser, bands: np.ndarray, steps: int, seed: int) -> tuple[float, float, float]:
    """(mean ms of a choice, mean ms of a choice that priced the cuts, mean ms of the learning
    between two choices) over ``steps`` served steps (means: a choice kept without pricing
    is fast, one priced again is not)."""
    rng = np.random.default_rng(seed)
    req_ids = [f"request-{i}" for i in range(len(bands))]
    skill = rng.uniform(0.3, 1.0, len(bands))  # each request's own acceptance: groups of their own depths
    choose_ms, learn_ms, priced = [], [], []
    rates = chooser._rates
    chooser._rates = lambda *args: priced.__setitem__(-1, True) or rates(*args)
    for _ in range(steps):
        priced.append(False)
        start = time.perf_counter()
        cut = chooser.choose(bands, None, 0, 200.0, req_ids)
        choose_ms.append(1e3 * (time.perf_counter() - start))
        start = time.perf_counter()
        cost, acceptance = chooser.shapes[cut.shape]
        depths = chooser.request_depths if chooser.request_depths is not None else np.full(len(bands), cut.depth)
        drafted = depths > 0  # the engine verifies (and learns from) drafted requests only
        if drafted.any():
            accepted = rng.geometric(1.0 - skill[drafted] * 0.95) - 1
            ids = [r for r, d in zip(req_ids, drafted) if d]
            acceptance.observe(bands[drafted], depths[drafted], np.minimum(depths[drafted], accepted), ids)
        work = cost.mixed_work(depths.tolist())
        cost.observe(cut.depth, work, cost.raw_seconds(work) * rng.uniform(1.0, 1.3), len(bands))
        learn_ms.append(1e3 * (time.perf_counter() - start))
    choose_ms, priced = np.array(choose_ms[steps // 10 :]), np.array(priced[steps // 10 :])
    priced_ms = float(choose_ms[priced].mean()) if priced.any() else float("nan")
    return float(choose_ms.mean()), priced_ms, float(np.mean(learn_ms[steps // 10 :]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tree", default="2x5")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    args = parser.parse_args()

    rows = []
    exhaustive = tree_choice.EXHAUSTIVE_MIXES
    for batch in args.batches:
        for mixed in (False, True):
            if mixed and batch < 4:
                continue
            bands = np.arange(batch) % 4 if mixed else np.full(batch, 2)
            for search, limit in (("every mix", exhaustive), ("coordinate ascent", 1)):
                if batch == 1 and search != "every mix":
                    continue  # one request: no mix to search
                tree_choice.EXHAUSTIVE_MIXES = limit
                choose, priced, learn = time_steps(serving_chooser(args.max_tree), bands, args.steps, seed=batch)
                rows.append((batch, "4 bands" if mixed else "1 band", search, choose, priced, learn))
                print(rows[-1], flush=True)
        tree_choice.EXHAUSTIVE_MIXES = exhaustive
        # No cut pays: every step plain, the choice settled between pricings (``SETTLED_DECISIONS``).
        choose, priced, learn = time_steps(
            serving_chooser(args.max_tree, draft_pays=False), bands, args.steps, seed=batch
        )
        rows.append(
            (
                batch,
                "4 bands, drafting cannot pay" if batch >= 4 else "1 band, drafting cannot pay",
                "every mix",
                choose,
                priced,
                learn,
            )
        )
        print(rows[-1], flush=True)

    lines = [
        "# Host time of tree auto's choice per step",
        "",
        f"`python -m benchmarks.sizer_overhead --max-tree {args.max_tree} --steps {args.steps}` on "
        f"{platform.processor() or platform.machine()} ({platform.platform()}), Python "
        f"{sys.version.split()[0]}, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC. Means over served steps "
        f"(choice, then the acceptance and cost models learning from the step); share: of a "
        f"{STEP_MS_H200_7B:.0f} ms H200 7B decode step, for scale.",
        "",
        "| batch | temperatures | group depths | choose (ms) | of it, a choice that prices (ms) | learn (ms) "
        "| share of a 7 ms step |",
        "|---|---|---|---|---|---|---|",
    ]
    for batch, kind, search, choose, priced, learn in rows:
        share = 100 * (choose + learn) / STEP_MS_H200_7B
        search = search if batch > 1 else "-"
        lines.append(f"| {batch} | {kind} | {search} | {choose:.3f} | {priced:.3f} | {learn:.3f} | {share:.1f} % |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sizer_overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
