"""``logit_bias`` and ``min_p`` on every tree row, as vLLM applies them without speculation.

vLLM refuses both with any speculative decoding (its engine then builds no
logits processor for them). Neither depends on the text a row continues, so
tree verification applies them to every row of a request:

* ``logit_bias`` is added to the logits after allowed tokens, bad words and
  min_tokens and before the penalties (vLLM's non-argmax-invariant processors),
  so it also moves the argmax of greedy requests;
* ``min_p`` masks, after temperature and before top-k / top-p, every token whose
  probability is below min_p times the row's largest (vLLM's ``MinPLogitsProcessor``).

The per-request values come from the requests' own SamplingParams, read once
per batch composition.
"""

from __future__ import annotations

import torch


class RequestBiasAndMinP:
    """The batch's logit biases and min_p values, rebuilt only when the batch's requests change."""

    def __init__(self):
        self._key: tuple[str, ...] | None = None
        self._bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._min_p: torch.Tensor | None = None

    def update(self, req_ids: list[str], params_of, device: torch.device) -> None:
        """req_ids: the batch's request ids in row order; params_of(req_id) -> SamplingParams."""
        key = tuple(req_ids)
        if key == self._key:
            return
        rows, tokens, values, min_p = [], [], [], []
        for row, req_id in enumerate(req_ids):
            params = params_of(req_id)
            for token, value in (getattr(params, "logit_bias", None) or {}).items():
                rows.append(row)
                tokens.append(int(token))
                values.append(float(value))
            min_p.append(float(getattr(params, "min_p", 0.0) or 0.0))
        self._bias = None
        if rows:
            self._bias = (
                torch.tensor(rows, device=device),
                torch.tensor(tokens, device=device),
                torch.tensor(values, dtype=torch.float32, device=device),
            )
        self._min_p = torch.tensor(min_p, dtype=torch.float32, device=device) if any(min_p) else None
        self._key = key

    @property
    def any(self) -> bool:
        """Some request of the batch sets logit_bias or min_p (which vLLM's own sampler,
        under speculative decoding, leaves out)."""
        return self._bias is not None or self._min_p is not None

    @property
    def min_p(self) -> torch.Tensor | None:
        """[B] float32, or None when no request of the batch sets min_p."""
        return self._min_p

    def logit_bias(self) -> TreeLogitBias | None:
        return TreeLogitBias(*self._bias) if self._bias is not None else None


class TreeLogitBias:
    """A path transform (see ``target_probs.tree_target_probs``) adding each request's biases to all its rows.

    rows, tokens [n] LongTensor, values [n] float32: request row, token id, bias.
    """

    def __init__(self, rows: torch.Tensor, tokens: torch.Tensor, values: torch.Tensor):
        self.rows, self.tokens, self.values = rows, tokens, values

    def apply(self, logits: torch.Tensor) -> None:
        """logits [B, T, V] float32, in place."""
        logits[self.rows, :, self.tokens] += self.values.unsqueeze(-1)


def apply_min_p_(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logits [R, V] (after temperature), min_p [R] -> logits with every token whose
    probability is below min_p * (the row's largest probability) at -inf, in place."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(-1, keepdim=True).mul_(min_p.unsqueeze(-1))
    return logits.masked_fill_(probs < threshold, float("-inf"))
