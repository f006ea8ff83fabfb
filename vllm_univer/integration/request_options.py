"""Per-request sampling options that tree verification cannot honour (yet).

Tree rows at different depths and on different paths continue different
texts, so options whose logits transform depends on the tokens generated so
far need one transform per path. Penalties are applied per path
(``target_probs.TreePenalties``); the options below are not yet, so they are
refused per request, before the request reaches the engine. No vLLM import.
"""

from __future__ import annotations


def unsupported_option(params) -> tuple[str, str] | None:
    """(parameter, message) for the first option of ``params`` (vLLM SamplingParams)
    that ``method: "univer"`` cannot honour exactly, else None."""
    checks = (
        ("bad_words", bool(getattr(params, "bad_words", None)), "bad_words"),
        ("allowed_token_ids", params.allowed_token_ids is not None, "allowed_token_ids"),
        ("min_tokens", params.min_tokens > 0, "min_tokens"),
        ("structured_outputs", getattr(params, "structured_outputs", None) is not None, "structured outputs"),
        ("logits_processors", bool(getattr(params, "logits_processors", None)), "custom logits processors"),
    )
    for parameter, refused, what in checks:
        if refused:
            return parameter, (
                f"{what} is not supported with tree speculative decoding (method 'univer'): "
                "its effect depends on the tokens generated so far, which differ between tree paths; "
                "send the request without it or use a server without --speculative-config"
            )
    return None
