"""Allowed tokens, bad words and min_tokens on every tree row, as vLLM's Sampler
applies them to the one row it samples.

The row of node i continues the request's text with the tokens on the path to
i (depth d = i's depth), so

* ``allowed_token_ids``: the request's mask, the same on every row;
* ``bad_words``: a bad word's last token is banned on a row whose last
  generated tokens (the request's output, then the path) equal the word's
  other tokens (vLLM's ``apply_bad_words``; the prompt does not count);
* ``min_tokens``: the row samples output token number len(output) + d, so the
  stop tokens are banned while len(output) + d < min_tokens (vLLM's
  ``MinTokensLogitsProcessor``).

Every ban sets a logit to -inf, so the three commute with each other and with
the penalties applied after them. Work is batched over requests, rows and
words; only the small index tensors are built on the host, once per step.
"""

from __future__ import annotations

import torch

NO_TOKEN = -2  # history position before the first generated token
ANY_TOKEN = -3  # bad-word prefix position that matches anything (shorter words)


def min_tokens_state(sampling_metadata) -> dict[int, tuple]:
    """vLLM's per-request min_tokens state: batch row -> (min_tokens, output ids, stop ids, ...)."""
    from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor

    for processor in sampling_metadata.logitsprocs.non_argmax_invariant:
        if isinstance(processor, MinTokensLogitsProcessor):
            return processor.min_toks
    return {}


class TreePathMasks:
    """paths [B, T, D]: the tokens on the path to each row's node (depth 1 .. D, -1
    past its depth or where no node is: ``token_paths`` of the step's trees); depth
    [T]; sampling_metadata: vLLM's."""

    def __init__(self, paths: torch.Tensor, depth: torch.Tensor, sampling_metadata, batch: int):
        self.paths, self.depth = paths, depth
        self.meta, self.batch = sampling_metadata, batch
        self.bad_words = {b: w for b, w in (sampling_metadata.bad_words_token_ids or {}).items() if b < batch}
        self.min_tokens = {b: s for b, s in min_tokens_state(sampling_metadata).items() if b < batch}

    @staticmethod
    def needed(sampling_metadata) -> bool:
        return (
            sampling_metadata.allowed_token_ids_mask is not None
            or bool(sampling_metadata.bad_words_token_ids)
            or bool(min_tokens_state(sampling_metadata))
        )

    def apply(self, logits: torch.Tensor) -> None:
        """logits [B, T, V] float32, in place."""
        allowed = self.meta.allowed_token_ids_mask  # [num_reqs, V], True = not allowed
        if allowed is not None:
            logits.masked_fill_(allowed[: self.batch].unsqueeze(1), float("-inf"))
        if self.bad_words:
            self._ban_bad_words(logits)
        if self.min_tokens:
            self._ban_early_stops(logits)

    def _ban(self, logits, request, token, banned) -> None:
        """Set logits[request[e], t, token[e]] = -inf where banned[e, t]; request/token [E], banned [E, T]."""
        rows = logits.shape[1]
        values = torch.zeros(banned.shape, dtype=logits.dtype, device=logits.device)
        values.masked_fill_(banned, float("-inf"))
        t = torch.arange(rows, device=logits.device).unsqueeze(0).expand_as(banned)
        # accumulate: two bans of one entry add -inf twice instead of racing.
        logits.index_put_(
            (request.unsqueeze(1).expand_as(banned), t, token.unsqueeze(1).expand_as(banned)), values, accumulate=True
        )

    def _ban_bad_words(self, logits: torch.Tensor) -> None:
        device = logits.device
        words = [(b, w) for b, ws in self.bad_words.items() for w in ws]
        history = max(len(w) for _, w in words) - 1  # generated tokens a ban looks back at
        request = torch.tensor([b for b, _ in words], device=device)
        last = torch.tensor([w[-1] for _, w in words], device=device)
        if history == 0:
            self._ban(logits, request, last, torch.ones(len(words), logits.shape[1], dtype=torch.bool, device=device))
            return
        prefix = torch.tensor(
            [[ANY_TOKEN] * (history - len(w) + 1) + list(w[:-1]) for _, w in words], device=device
        )  # [W, H], right-aligned
        outputs = self.meta.output_token_ids
        tails = {b: outputs[b][-history:] for b in self.bad_words}
        tail = torch.tensor(
            [[NO_TOKEN] * (history - len(tails[b])) + list(tails[b]) for b, _ in words], device=device
        )  # [W, H]
        # Path tokens of every row (depth 1 .. d), NO_TOKEN past the row's depth.
        rows = self.paths.shape[1]
        path = self.paths[request].masked_fill(self.paths[request] < 0, NO_TOKEN)  # [W, T, D]
        text = torch.cat([tail.unsqueeze(1).expand(-1, rows, -1), path], -1)  # [W, T, H + D]
        # The last H tokens of row t's text end at position H + depth(t).
        window = self.depth.to(device).unsqueeze(1) + torch.arange(history, device=device).unsqueeze(0)  # [T, H]
        recent = text.gather(2, window.unsqueeze(0).expand(len(words), -1, -1))
        match = ((recent == prefix.unsqueeze(1)) | (prefix.unsqueeze(1) == ANY_TOKEN)).all(-1)  # [W, T]
        self._ban(logits, request, last, match)

    def _ban_early_stops(self, logits: torch.Tensor) -> None:
        device = logits.device
        entries = [(b, stop, state[0] - len(state[1])) for b, state in self.min_tokens.items() for stop in state[2]]
        if not entries:
            return
        request, stop, remaining = (torch.tensor(column, device=device) for column in zip(*entries))
        banned = self.depth.to(device).unsqueeze(0) < remaining.unsqueeze(1)  # [E, T]
        self._ban(logits, request, stop, banned)
