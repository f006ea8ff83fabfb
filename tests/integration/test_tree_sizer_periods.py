"""What ``TreeSizer`` times as a cut's step: from the end of one verification to the
end of the next (the cut's drafting, the target forward over its trees, their
verification), never a period that ran another cut's verification, a request
joining or a catch-up chunk. A fake runner and drafter; the clock is set by hand."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm_univer.core.tree import TreeSpec  # noqa: E402
from vllm_univer.integration import tree_sizer  # noqa: E402
from vllm_univer.sizing import (  # noqa: E402
    AcceptanceModel,
    Cut,
    ForwardCost,
    ShapeModels,
    StepCostModel,
    TreeChooser,
)


class Steps:
    """A runner, a drafter and a clock: each ``step`` is one engine step as the
    runner calls the sizer (the choice made ahead, then drafting)."""

    def __init__(self, monkeypatch, device: str):
        self.now = 0.0
        monkeypatch.setattr(tree_sizer.time, "perf_counter", lambda: self.now)
        self.input_batch = SimpleNamespace(num_reqs=4, req_ids=["a", "b", "c", "d"])
        self.runner = SimpleNamespace(
            device=torch.device(device),
            parallel_config=SimpleNamespace(tensor_parallel_size=1),
            input_batch=self.input_batch,
            query_start_loc=SimpleNamespace(np=np.zeros(65, dtype=np.int32)),
        )
        self.drafter = SimpleNamespace(forward_tokens=[], chunk_tokens=0)
        self.shapes = TreeSpec.parse("2x3").width_cuts()  # the chain 1x3, then 2x3
        self.sizer = tree_sizer.TreeSizer(self.runner, self.shapes, self.drafter)
        flat = ForwardCost([1, 1000], [0.1, 0.1])
        models = [
            ShapeModels(StepCostModel(flat, flat, s.nodes_per_depth), AcceptanceModel(s.max_depth)) for s in self.shapes
        ]
        self.sizer.chooser = TreeChooser(models)
        self.observed = []
        for index, (cost, _) in enumerate(models):
            cost.observe = lambda depth, work, seconds, batch, index=index: self.observed.append(
                (index, depth, work.target_tokens, list(work.draft_tokens), round(seconds, 6), batch)
            )

    def step(self, at: float, target_tokens: int, cut: Cut, draft_tokens: list[int], chunk: int = 0) -> None:
        """At time ``at`` the step's target forward (``target_tokens`` rows) and
        verification have run; the sizer hands out ``cut`` and the drafter runs ``draft_tokens``."""
        batch = self.input_batch.num_reqs
        self.runner.query_start_loc.np[batch] = target_tokens
        self.now = at
        self.sizer.step_started()
        self.sizer._last = cut  # the choice, as made ahead during the target forward
        self.sizer._ahead = (tuple(self.input_batch.req_ids[:batch]), (self.shapes[cut.shape], cut.depth))
        self.sizer.choose(batch)
        self.drafter.forward_tokens, self.drafter.chunk_tokens = draft_tokens, chunk
        self.sizer.draft_launched()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_each_cut_is_timed_over_its_own_drafting_forward_and_verification(monkeypatch, device):
    """On a CPU the host runs each forward to its end: a period ends where drafting
    starts. On a GPU (``cuda``: only the flag is read) it ends when the drafter has
    waited for the verification's results (``draft_launched``), after the next cut
    was handed out: each cut is still timed over its own step (the fake clock
    stands still within a step, so both see the same periods)."""
    steps = Steps(monkeypatch, device)
    rows_2x3 = [1, 3, 7, 15]  # target rows per request at depth cuts 0..3 of 2x3
    steps.step(0.0, 4, Cut(1, 2), [8, 8])  # 2x3 cut to depth 2 for 4 requests
    steps.step(1.0, 4 * rows_2x3[2], Cut(1, 0), [])  # its trees verified; plain next
    steps.step(1.3, 4, Cut(1, 2), [8, 8])  # the plain step; 2x3 again
    steps.step(2.3, 4 * rows_2x3[2], Cut(0, 1), [4])
    assert steps.observed == [
        (1, 2, 28, [8, 8], 1.0, 4),  # the speculating step, its shape's model only
        (0, 0, 4, [], 0.3, 4),  # the plain step, every shape's model
        (1, 0, 4, [], 0.3, 4),
        (1, 2, 28, [8, 8], 1.0, 4),
    ], steps.observed


def test_periods_of_joins_and_catch_up_chunks_teach_nothing(monkeypatch):
    steps = Steps(monkeypatch, "cpu")
    steps.step(0.0, 4, Cut(1, 1), [8], chunk=16)  # a catch-up chunk ran with the drafting
    steps.step(1.0, 12, Cut(1, 1), [8])  # its period: not a decode step of the cut
    steps.input_batch.num_reqs, steps.input_batch.req_ids = 5, ["a", "b", "c", "d", "e"]
    steps.step(2.0, 12 + 60, Cut(1, 1), [10])  # a request joined: its prefill ran in the period
    steps.step(3.0, 15, Cut(1, 1), [10])  # a decode step of 5 requests at depth 1
    steps.step(3.5, 15, Cut(1, 1), [10])
    assert steps.observed == [(1, 1, 15, [10], 1.0, 5), (1, 1, 15, [10], 0.5, 5)], steps.observed
