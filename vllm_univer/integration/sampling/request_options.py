"""Per-request sampling options that tree verification cannot honour (yet).

Tree rows at different depths and on different paths continue different
texts, so options whose logits transform depends on the tokens generated so
far need one transform per path. Penalties (``target_probs.TreePenalties``),
allowed tokens, bad words and min_tokens (``path_masks.TreePathMasks``) and
structured outputs (``tree_grammar``: a grammar state per node) have one.
Structured outputs that start only once a reasoning parser sees the end of
the reasoning do not, nor does ``thinking_token_budget`` (vLLM forces the end of
thinking once a count of thinking tokens passes the budget): where reasoning
ends differs between paths, so both are refused per request, before the
request reaches the engine. (Custom logits processors are engine-wide in vLLM
0.32 and refused at start-up by ``TreeSpeculation``.)
No vLLM import.
"""

from __future__ import annotations


def unsupported_option(params, structured_outputs_config=None) -> tuple[str, str] | None:
    """(parameter, message) for the first option of ``params`` (vLLM SamplingParams)
    that ``method: "univer"`` cannot honour exactly, else None.

    structured_outputs_config: the engine's (vLLM ``StructuredOutputsConfig``), or None.
    """
    grammar_after_reasoning = (
        getattr(params, "structured_outputs", None) is not None
        and structured_outputs_config is not None
        and bool(getattr(structured_outputs_config, "reasoning_parser", ""))
        and not getattr(structured_outputs_config, "enable_in_reasoning", False)
    )
    if getattr(params, "thinking_token_budget", None) is not None:
        return "thinking_token_budget", (
            "thinking_token_budget is not supported with tree speculative decoding (method 'univer'): "
            "the count of thinking tokens differs between tree paths; send the request without it "
            "or use a server without --speculative-config"
        )
    if grammar_after_reasoning:
        return "structured_outputs", (
            "structured outputs with a reasoning parser are not supported with tree speculative decoding "
            "(method 'univer'): the grammar starts where reasoning ends, which differs between tree paths; "
            "send the request without structured outputs, start the server with "
            "--structured-outputs-config.enable_in_reasoning=true, or without --reasoning-parser"
        )
    return None


def has_structured_output(requests: dict, req_ids) -> bool:
    """Whether any of ``req_ids`` (keys of the runner's ``requests``) asks for
    structured outputs: such a step drafts a tree the scheduler's grammar knows
    (``UniverConfig.grammar_tree``)."""
    return any(
        (params := requests[r].sampling_params) is not None and params.structured_outputs is not None for r in req_ids
    )
