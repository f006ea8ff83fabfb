"""Greedy identity, aware of floating-point near-ties.

Temperature 0 takes the argmax of the target's processed logits. A tree row and
the plain decode row of the same context compute those logits in a different
order (another batch shape, another attention kernel), so their log-probabilities
agree to rounding only: at most ``LOGPROB_ROUNDING`` apart
(``test_engine.py::test_logprobs_are_the_targets`` asserts that bound on every
top-3 logprob of 120 positions; measured worst cases: 9.5e-7 on an AVX2 EPYC,
see ``test_logprobs_are_the_targets`` for this machine's figure).

If the reference's top-2 margin at some position is at least
``TIE_MARGIN = 2 * LOGPROB_ROUNDING``, no rounding within that bound can swap
the two tokens, so speculation must pick the reference's token there. Below it,
either of the two is a correct argmax and the texts may legitimately part: the
comparison stops at the first such position (and checks the token taken there
is one of the two). Everything before it must be identical, and a test fails
if near-ties cut its comparison short (``MIN_COMPARED_SHARE``).
"""

from __future__ import annotations

import math

LOGPROB_ROUNDING = 4e-6
TIE_MARGIN = 2 * LOGPROB_ROUNDING
# Near-ties are rare (the tiny models' logits are spread over several units), so
# a comparison cut short is a finding, not a pass: each output must be compared
# on its first MIN_COMPARED_PREFIX tokens (several tree steps), and a test on at
# least MIN_COMPARED_SHARE of all its reference tokens.
MIN_COMPARED_PREFIX = 16
MIN_COMPARED_SHARE = 0.5


def top2_from_logprobs(steps: list[dict]) -> tuple[list[float], list[list]]:
    """Per position, (top-1 minus top-2 logprob, [top-1 token, top-2 token]) from
    per-position {token: logprob} dicts (vLLM's, or the OpenAI API's top_logprobs;
    asked with ``logprobs >= 2``)."""
    margins, tops = [], []
    for step in steps:
        ranked = sorted(((lp, tok) for tok, lp in step.items()), reverse=True)
        if len(ranked) < 2 or ranked[1][0] == -math.inf:
            margins.append(math.inf)
        else:
            margins.append(ranked[0][0] - ranked[1][0])
        tops.append([tok for _, tok in ranked[:2]])
    return margins, tops


def compared_length(margins: list[float]) -> int:
    """Positions before the reference's first near-tie (all of them if none)."""
    return next((i for i, m in enumerate(margins) if m < TIE_MARGIN), len(margins))


def truncated(reference: dict, length: int, index: int = 0) -> dict:
    """Output ``index`` of a reference call result cut to its first ``length`` tokens."""
    return {key: [reference[key][index][:length]] for key in ("outputs", "margins", "top2")}


def assert_greedy_identical(outputs: list[list[int]], reference: dict, label="") -> None:
    """``outputs`` (token ids per prompt) equal the reference's up to its first
    near-tie; ``reference``: a call result of an engine run with ``margins``
    (``engine_job``): {"outputs", "margins", "top2"}."""
    ref_outputs, margins, top2 = reference["outputs"], reference["margins"], reference["top2"]
    assert len(outputs) == len(ref_outputs), label
    compared = 0
    for i, (out, ref, ref_margins, ref_top2) in enumerate(zip(outputs, ref_outputs, margins, top2)):
        n = compared_length(ref_margins)
        if n == len(ref):
            assert out == ref, (label, i)
        else:
            print(
                f"[greedy identity] {label} output {i}: near-tie at position {n} of {len(ref)} "
                f"(top-2 margin {ref_margins[n]:.2e} < {TIE_MARGIN:.0e}); compared up to it"
            )
            assert out[:n] == ref[:n], (label, i, n)
            assert len(out) > n and out[n] in ref_top2[n], (label, i, n, out[n : n + 1], ref_top2[n])
            assert n >= min(len(ref), MIN_COMPARED_PREFIX), (label, i, n, "near-tie too early")
        compared += n
    total = sum(len(ref) for ref in ref_outputs)
    assert compared >= MIN_COMPARED_SHARE * total, (label, compared, total, "near-ties cut the comparison short")


def assert_greedy_text_identical(
    text: str, ref_text: str, ref_token_ids: list[int], ref_top_logprobs: list[dict[str, float]], decode, label=""
) -> None:
    """A server's greedy ``text`` equals the reference server's ``ref_text`` up to
    the reference's first near-tie. The reference completion came with top-2
    logprobs and ``return_tokens_as_token_ids`` (``openai_reference``);
    ``decode`` turns token ids into text (the model's tokenizer)."""
    margins, _ = top2_from_logprobs(ref_top_logprobs)
    n = compared_length(margins)
    if n == len(ref_token_ids):
        assert text == ref_text, label
        return
    print(
        f"[greedy identity] {label}: near-tie at position {n} of {len(ref_token_ids)} "
        f"(top-2 margin {margins[n]:.2e} < {TIE_MARGIN:.0e}); compared up to it"
    )
    # A prefix cut inside a multi-byte character decodes to a replacement character.
    assert text.startswith(decode(ref_token_ids[:n]).rstrip("\ufffd")), (label, n)
    assert n >= min(len(ref_token_ids), MIN_COMPARED_PREFIX), (label, n, "near-tie too early")


# Ask an OpenAI-compatible vLLM server for what ``assert_greedy_text_identical`` needs.
OPENAI_TOP2 = {
    "completions": {"logprobs": 2, "extra_body": {"return_tokens_as_token_ids": True}},
    "chat": {"logprobs": True, "top_logprobs": 2, "extra_body": {"return_tokens_as_token_ids": True}},
}


def token_id(token: str) -> int:
    """'token_id:123' (``return_tokens_as_token_ids``) -> 123."""
    return int(token.rsplit(":", 1)[1])
