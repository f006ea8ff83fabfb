"""``DraftLevelGraphs`` on its own, over a stand-in draft model that returns what
it read: which forwards take a graph (every request the same number of tokens,
requests up to the largest bucket), one capture per size, the inputs and the
attention plan in persistent buffers (the padding's cache slots at -1, a causal
level's context and mask), and the hidden rows of the real tokens only. The
engine test (``test_draft_forward.py::test_level_forwards_under_full_graphs``)
runs it with the real draft model."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config import VllmConfig  # noqa: E402
from vllm.forward_context import get_forward_context  # noqa: E402

from vllm_univer.integration.draft_inputs import LevelInputs  # noqa: E402
from vllm_univer.integration.draft_level_graphs import (  # noqa: E402
    DraftLevelGraphs,
    padded_requests,
    rerun_capture,
)

MAX_TOKENS = 32
LAYERS = ["draft.layers.0.attn", "draft.layers.1.attn"]


class _Proposer:
    """What ``DraftLevelGraphs`` reads of vLLM's draft proposer; its model returns
    [token id, position, slot, the plan's context length of the token's request]
    per token, and records each forward's plan buffers."""

    uses_mrope = False
    supports_mm_inputs = False

    def __init__(self):
        self.vllm_config = VllmConfig()
        self.input_ids = torch.zeros(MAX_TOKENS, dtype=torch.int32)
        self.positions = torch.zeros(MAX_TOKENS, dtype=torch.int64)
        self._slots = torch.zeros(MAX_TOKENS, dtype=torch.int64)
        self._draft_attn_layer_names = LAYERS
        self.plans = []
        self.model = self._model

    def _get_slot_mapping(self, num_tokens, slot_mapping=None):
        if slot_mapping is not None:
            self._slots[: len(slot_mapping)].copy_(slot_mapping)
            self._slots[len(slot_mapping) : num_tokens].fill_(-1)
        return {name: self._slots[:num_tokens] for name in LAYERS}

    def _model(self, input_ids, positions, inputs_embeds):
        context = get_forward_context()
        plan = context.attn_metadata[LAYERS[0]].tree_plan
        assert all(context.attn_metadata[name].tree_plan is plan for name in LAYERS)
        self.plans.append(plan)
        slots = context.slot_mapping[LAYERS[0]]
        width = plan.buffers.num_queries
        request_context = plan.buffers.context_lens.repeat_interleave(width)
        return torch.stack([input_ids.long(), positions, slots, request_context], 1).float()


def _level(reqs: int, width: int, context: list[int]) -> tuple[torch.Tensor, LevelInputs]:
    """A level of ``reqs`` requests of ``width`` tokens each, request r's tokens at
    positions context[r] .. context[r] + width - 1."""
    positions = torch.cat([torch.arange(c, c + width) for c in context])
    seq_lens = torch.tensor([c + width for c in context], dtype=torch.int32)
    starts = torch.arange(reqs + 1, dtype=torch.int32) * width
    level = LevelInputs(
        token_ids=None,
        positions=positions,
        slot_mapping=positions + 1000,
        query_start_loc=starts,
        query_start_loc_cpu=starts,
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens,
        max_query_len=width,
        max_seq_len=int(seq_lens.max()),
    )
    return torch.arange(reqs * width) + 7, level


def test_padded_requests_are_powers_of_two():
    assert [padded_requests(n) for n in (1, 2, 3, 4, 5, 8, 9, 33)] == [1, 2, 4, 4, 8, 8, 16, 64]


def test_uniform_levels_replay_one_graph_per_size():
    proposer = _Proposer()
    captures = []

    def capture(fn):
        captures.append(fn)
        return rerun_capture(fn)

    graphs = DraftLevelGraphs(proposer, max_model_len=128, max_reqs=8, capture=capture)
    table = torch.arange(3 * 8, dtype=torch.int32).view(3, 8)
    for context in ([5, 9, 20], [40, 3, 11]):  # two steps of the same size: one capture
        tokens, level = _level(3, 2, context)
        hidden = graphs.forward(tokens, level, table, plan=None)
        assert hidden.shape == (6, 4)
        assert hidden[:, 0].long().tolist() == tokens.tolist()
        assert hidden[:, 1].long().tolist() == level.positions.tolist()
        assert hidden[:, 2].long().tolist() == (level.positions + 1000).tolist()
        # A causal level as a plan: each request's context is the keys before its first token.
        assert hidden[:, 3].long().tolist() == [c for c in context for _ in range(2)]
        buffers = proposer.plans[-1].buffers
        assert buffers.max_reqs == 4 and buffers.row_valid.tolist() == [[1, 1]] * 3 + [[0, 0]]
        assert buffers.mask[:3].tolist() == [[[1, 0], [1, 1]]] * 3
        assert torch.equal(buffers.block_table[:3], table)
        assert proposer._slots[6:8].tolist() == [-1, -1]  # the padding writes no key or value
    assert len(captures) == 1 and graphs.replays == 2 and list(graphs.graphs) == [(2, 2, 4)]
    # Another width, another request bucket: another graph each.
    tokens, level = _level(1, 2, [30])
    graphs.forward(tokens, level, table[:1], plan=None)
    tokens, level = _level(3, 1, [30, 31, 32])
    graphs.forward(tokens, level, table, plan=None)
    assert sorted(graphs.graphs) == [(1, 1, 4), (2, 2, 1), (2, 2, 4)] and len(captures) == 3


def test_other_forwards_keep_the_piecewise_path():
    proposer = _Proposer()
    graphs = DraftLevelGraphs(proposer, max_model_len=128, max_reqs=4, capture=rerun_capture)
    table = torch.zeros(8, 8, dtype=torch.int32)
    tokens, level = _level(2, 3, [4, 9])
    # Not every request runs as many tokens (a prompt catching up at level 0).
    ragged = level._replace(max_query_len=4)
    assert graphs.forward(tokens, ragged, table[:2], plan=None) is None
    tokens, level = _level(5, 1, [4, 5, 6, 7, 8])  # 5 requests: the bucket of 8 is past max_reqs
    assert graphs.forward(tokens, level, table[:5], plan=None) is None
    tokens, level = _level(4, 9, [1, 2, 3, 4])  # 4 x 9 tokens do not fit the proposer's buffers
    assert graphs.forward(tokens, level, table[:4], plan=None) is None
    multimodal = _Proposer()
    multimodal.supports_mm_inputs = True
    tokens, level = _level(1, 1, [3])
    assert DraftLevelGraphs(multimodal, 128, 4, rerun_capture).forward(tokens, level, table[:1], None) is None
    assert graphs.graphs == {} and proposer.plans == []
