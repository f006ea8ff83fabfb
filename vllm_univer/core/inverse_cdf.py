"""Drawing tokens from unnormalised weights by a two-stage inverse CDF.

``BlockCdf(weights)`` sums the vocabulary in blocks of ``block`` tokens once (the
only pass over the whole rows); every ``draw`` then costs O(blocks + block) per
row: u ~ U[0, 1) picks the block whose cumulative block sums (float64) bracket
u * total, then the token inside that block from the block's own float64
cumulative sum. A draw may exclude some tokens (their weight counts as 0), which
is how ``wor`` and ``topk1`` draw without copying q: the few blocks holding an
excluded token are summed again without it (exactly, not by subtraction, which
would cancel catastrophically when the excluded token holds most of a block).

Rows may have any leading shape and need not be contiguous (a slice of a kept
buffer): no [..., V] temporary is built and nothing is written to ``weights``.
Block sums are accumulated in the weights' dtype: exact to ~1e-16 for float64
weights, to ~1e-7 relative (the precision of the weights themselves) for
float32 ones. A zero-weight token (or block) never has a cumulative sum above
the previous one and is never drawn. No host sync.
"""

from __future__ import annotations

import torch

DEFAULT_BLOCK = 1024


class BlockCdf:
    """Block sums of ``weights`` [..., V] >= 0, for repeated draws from w / sum(w)."""

    def __init__(self, weights: torch.Tensor, block: int | None = None):
        self.weights = weights
        self.block = block = int(block or DEFAULT_BLOCK)
        vocab = weights.shape[-1]
        self.vocab = vocab
        self.num_blocks = nb = -(-vocab // block)
        full = vocab // block
        sums = [weights[..., : full * block].unflatten(-1, (full, block)).sum(-1)] if full else []
        if full < nb:
            sums.append(weights[..., full * block :].sum(-1, keepdim=True))
        # One spare column at the end takes the writes of absent (-1) excluded tokens.
        self.block_sums = torch.cat(sums + [weights.new_zeros(weights.shape[:-1] + (1,))], -1)  # [..., nb + 1]

    def draw(self, generator: torch.Generator | None = None, exclude: torch.Tensor | None = None) -> torch.Tensor:
        """One token per row [...] with P(i) = w_i / sum(w) over the tokens not in
        ``exclude`` [..., k] (-1 entries ignored); -1 for a row with no such mass."""
        block = self.block
        block_cdf = self._sums_without(exclude).to(torch.float64).cumsum(-1)  # [..., nb]
        total = block_cdf[..., -1:].contiguous()
        u = torch.rand(total.shape, generator=generator, device=total.device, dtype=torch.float64)
        target = u * total
        # The first block whose cumulative sum exceeds the target; u * total can round
        # up to the total (probability ~2^-53): cap at the last block of positive weight.
        chosen = torch.minimum(
            torch.searchsorted(block_cdf, target, right=True), torch.searchsorted(block_cdf, total, right=False)
        )  # [..., 1]
        before = torch.where(chosen > 0, block_cdf.gather(-1, (chosen - 1).clamp(min=0)), torch.zeros_like(target))
        inner_cdf = self._block_weights(chosen, exclude).squeeze(-2).to(torch.float64).cumsum(-1)  # [..., block]
        # The same rule inside the block; rounding between the two sums can put the
        # remainder at or past the block's end: cap at its last token of positive weight.
        remainder = (target - before).clamp(min=0)
        offset = torch.minimum(
            torch.searchsorted(inner_cdf, remainder, right=True),
            torch.searchsorted(inner_cdf, inner_cdf[..., -1:].contiguous(), right=False),
        )
        token = (chosen * block + offset).squeeze(-1)
        return torch.where(total.squeeze(-1) > 0, token, -1)

    def total(self, exclude: torch.Tensor | None = None) -> torch.Tensor:
        """sum(w) over the tokens not in ``exclude`` [..., k] (-1 entries ignored) -> [..., 1]
        in the weights' dtype, each block summed without them (no cancellation)."""
        return self._sums_without(exclude).to(torch.float64).sum(-1, keepdim=True).to(self.weights.dtype)

    def _sums_without(self, exclude: torch.Tensor | None) -> torch.Tensor:
        """The block sums [..., nb], the blocks holding excluded tokens summed again without them."""
        sums = self.block_sums
        if exclude is not None and exclude.shape[-1] > 0:
            hit_block = torch.where(exclude >= 0, exclude // self.block, self.num_blocks)  # [..., k] (nb: spare)
            sums = sums.scatter(-1, hit_block, self._block_weights(hit_block, exclude).sum(-1))
        return sums[..., : self.num_blocks]

    def _block_weights(self, blocks: torch.Tensor, exclude: torch.Tensor | None) -> torch.Tensor:
        """blocks [..., j] -> the weights of each block [..., j, block], 0 past the
        vocabulary, in the spare block and at excluded tokens."""
        block, vocab = self.block, self.vocab
        columns = blocks.unsqueeze(-1) * block + torch.arange(block, device=blocks.device)  # [..., j, block]
        inside = columns < vocab
        picked = self.weights.gather(-1, columns.clamp(max=vocab - 1).flatten(-2)).view(columns.shape)
        picked = picked.masked_fill(~inside, 0)
        if exclude is None or exclude.shape[-1] == 0:
            return picked
        # Zero each excluded token inside each listed block; tokens of other blocks
        # (and -1) write into a spare column that is dropped.
        offset = exclude.unsqueeze(-2) - blocks.unsqueeze(-1) * block  # [..., j, k]
        offset = torch.where((exclude.unsqueeze(-2) >= 0) & (offset >= 0) & (offset < block), offset, block)
        padded = torch.cat([picked, picked.new_zeros(picked.shape[:-1] + (1,))], -1)
        return padded.scatter_(-1, offset, 0.0)[..., :block]


def sample_from_weights(
    weights: torch.Tensor, generator: torch.Generator | None = None, block: int | None = None
) -> torch.Tensor:
    """One index per row of ``weights`` [..., V] >= 0 with P(i) = w_i / sum(w) -> [...]
    (-1 for a row without mass). See ``BlockCdf``."""
    return BlockCdf(weights, block).draw(generator)
