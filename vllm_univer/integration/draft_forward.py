"""One forward of vLLM's draft model, replayed from its piecewise CUDA graphs.

vLLM captures the draft model's graphs at start-up (``DraftModelProposer``,
the target's capture sizes, PIECEWISE: attention, and with it the tree plan,
runs eagerly between the graph pieces). A graph replays the memory it was
captured on, so a forward that replays one must

* pad its token count up to a captured size (the proposer's dispatcher picks it),
* put its token ids, positions and cache slots into the proposer's persistent
  buffers (``input_ids``, ``positions``, the slot-mapping buffer), the padding
  slots at -1 so the padding tokens write no key or value,
* and read back only its own rows of the hidden states.

Without this the level forwards ran eagerly on a GPU (a launch per op of every
layer) while vLLM's own chain drafter replays graphs. Where nothing is captured
(CPU, ``enforce_eager``, a size above the largest capture) the forward runs
eagerly on the tensors it was given, as before.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from vllm.config import CUDAGraphMode
from vllm.forward_context import set_forward_context


class DraftModelInputs(NamedTuple):
    """What one draft forward runs on: ``num_tokens`` query tokens padded to
    ``padded``; input_ids [padded] int32, positions [padded] int64, slot_mappings
    {draft layer name: [padded] int64}; ``mode`` the graphs it replays (NONE: eager)."""

    mode: CUDAGraphMode
    num_tokens: int
    padded: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mappings: dict[str, torch.Tensor]


def draft_model_inputs(proposer, token_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor):
    """The inputs of a forward over T query tokens, in the proposer's graph buffers
    when a captured graph fits T.

    proposer: vLLM's draft proposer (its ``cudagraph_dispatcher`` and buffers);
    token_ids [T] (any integer dtype), positions [T] and slot_mapping [T] (int64)
    on the device. Returns ``DraftModelInputs``.
    """
    num_tokens = len(token_ids)
    mode, padded = CUDAGraphMode.NONE, num_tokens
    # Graphs captured on token ids and 1-D positions (a multimodal or M-RoPE draft
    # was captured on other inputs: it runs eagerly). The dispatcher alone, not the
    # proposer's data-parallel coordination: ranks run different numbers of level
    # forwards, a collective per forward could hang.
    if not (proposer.uses_mrope or proposer.supports_mm_inputs):
        mode, batch = proposer.cudagraph_dispatcher.dispatch(num_tokens)
        padded = batch.num_tokens
    if mode == CUDAGraphMode.NONE and padded == num_tokens:
        slot_mappings = {name: slot_mapping for name in proposer._draft_attn_layer_names}
        return DraftModelInputs(mode, num_tokens, padded, token_ids.to(torch.int32), positions, slot_mappings)
    proposer.input_ids[:num_tokens].copy_(token_ids)
    proposer.positions[:num_tokens].copy_(positions)
    slot_mappings = proposer._get_slot_mapping(padded, slot_mapping)  # padding slots -1
    return DraftModelInputs(
        mode, num_tokens, padded, proposer.input_ids[:padded], proposer.positions[:padded], slot_mappings
    )


def run_draft_model(proposer, inputs: DraftModelInputs, metadata) -> torch.Tensor:
    """Hidden states [T, H] of the draft model over ``inputs``' T query tokens
    (the padding rows dropped); metadata: attention metadata per draft layer name."""
    with set_forward_context(
        metadata,
        proposer.vllm_config,
        num_tokens=inputs.padded,
        cudagraph_runtime_mode=inputs.mode,
        slot_mapping=inputs.slot_mappings,
    ):
        hidden = proposer.model(input_ids=inputs.input_ids, positions=inputs.positions, inputs_embeds=None)
    if isinstance(hidden, tuple):
        hidden = hidden[0]
    return hidden[: inputs.num_tokens]
