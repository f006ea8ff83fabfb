"""Per-request sampling options that tree verification cannot honour (yet).

Tree rows at different depths and on different paths continue different
texts, so options whose logits transform depends on the tokens generated so
far need one transform per path. Penalties (``target_probs.TreePenalties``),
allowed tokens, bad words and min_tokens (``path_masks.TreePathMasks``) have
one; structured outputs (a grammar state per path) do not, so they are refused
per request, before the request reaches the engine. (Custom logits processors
are engine-wide in vLLM 0.32 and refused at start-up by ``TreeRunner``.)
No vLLM import.
"""

from __future__ import annotations


def unsupported_option(params) -> tuple[str, str] | None:
    """(parameter, message) for the first option of ``params`` (vLLM SamplingParams)
    that ``method: "univer"`` cannot honour exactly, else None."""
    checks = (
        ("structured_outputs", getattr(params, "structured_outputs", None) is not None, "structured outputs"),
    )
    for parameter, refused, what in checks:
        if refused:
            return parameter, (
                f"{what} is not supported with tree speculative decoding (method 'univer'): "
                "its effect depends on the tokens generated so far, which differ between tree paths; "
                "send the request without it or use a server without --speculative-config"
            )
    return None
