"""The draft forwards' inputs of one step, built on the host at once and copied
to the device in two transfers (one int64, one int32) for every level.

Everything a level forward needs besides its query tokens is known when the
step starts: the root positions, the block tables and the tree's level spans.
Built level by level, each forward made ~6 synchronous host-to-device copies
(slot mapping, positions, query starts, sequence lengths, block table, ancestor
mask), each a stream sync on CUDA: the GPU idled while the host prepared the
next level. Now the level loop launches without waiting for the device.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from .host_to_device import upload_packed


class LevelInputs(NamedTuple):
    """One draft forward's flat batch of T query tokens over R requests.

    token_ids: IntTensor [T] on the device (level 0; None for deeper levels,
        whose tokens are the drafted nodes, already on the device).
    positions: LongTensor [T], RoPE positions; slot_mapping: LongTensor [T],
        the cache slot each token's key/value is written to.
    query_start_loc / query_start_loc_cpu: IntTensor [R+1] on the device / host.
    seq_lens / seq_lens_cpu: IntTensor [R], keys each request's last query sees.
    max_query_len, max_seq_len: Python ints.
    """

    token_ids: torch.Tensor | None
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    max_query_len: int
    max_seq_len: int


class DraftStepInputs(NamedTuple):
    """levels[d]: inputs of the depth-d forward (d = 0 .. depth-1).
    root_tokens: LongTensor [R]; context_lens: LongTensor [R] (= root positions,
    the cached tokens every tree node sees); block_table: IntTensor [R, blocks]."""

    levels: list[LevelInputs]
    root_tokens: torch.Tensor
    context_lens: torch.Tensor
    block_table: torch.Tensor


def build_draft_step_inputs(
    level0: list[list[int]],
    start: np.ndarray,
    root_pos: np.ndarray,
    level_span: list[tuple[int, int]],
    depth: int,
    block_rows: torch.Tensor,
    block_size: int,
    device: torch.device,
    level_reqs: list[int] | None = None,
) -> DraftStepInputs:
    """Inputs of the ``depth`` draft forwards of one step.

    level0: per request, the tokens whose draft KV is missing, at positions
        start[r] .. root_pos[r] (the last one is the root).
    start, root_pos: int64 [R]. level_span[d]: (first, last) node of depth d.
    block_rows: the requests' block-table rows, int32 [R, blocks], on the host.
    Level d >= 1 runs nodes first..last of the first ``level_reqs[d]`` requests
    (None: of every request; requests cut shallower come last and drop out) at
    RoPE position root_pos + d, written to slot root_pos + node.
    """
    reqs = len(root_pos)
    level_reqs = level_reqs or [reqs] * depth
    lens = root_pos - start + 1
    query_start0 = np.concatenate([[0], np.cumsum(lens)])
    flat_pos = np.repeat(start, lens) + np.arange(query_start0[-1]) - np.repeat(query_start0[:-1], lens)
    token_ids = np.fromiter((t for chunk in level0 for t in chunk), dtype=np.int64, count=int(query_start0[-1]))
    table = block_rows.numpy().astype(np.int64)

    def slots(rows: np.ndarray, pos: np.ndarray) -> np.ndarray:
        return table[rows, pos // block_size] * block_size + pos % block_size

    # (positions, slot mapping, query starts, sequence lengths) per level.
    levels = [(flat_pos, slots(np.repeat(np.arange(reqs), lens), flat_pos), query_start0, root_pos + 1)]
    for d in range(1, depth):
        first, last = level_span[d]
        width, n = last - first + 1, level_reqs[d]
        slot_pos = (root_pos[:n, None] + np.arange(first, last + 1)[None]).ravel()
        levels.append(
            (
                np.repeat(root_pos[:n] + d, width),
                slots(np.repeat(np.arange(n), width), slot_pos),
                np.arange(n + 1) * width,
                root_pos[:n] + last + 1,
            )
        )

    wide = [root_pos, token_ids[query_start0[1:] - 1]] + [a for pos, slot, _, _ in levels for a in (pos, slot)]
    narrow = [token_ids, table] + [a for _, _, qs, sl in levels for a in (qs, sl)]
    wide_dev = upload_packed(wide, device, torch.int64)
    narrow_dev = upload_packed(narrow, device, torch.int32)

    inputs = []
    for d, (_, _, qs, sl) in enumerate(levels):
        inputs.append(
            LevelInputs(
                token_ids=narrow_dev[0] if d == 0 else None,
                positions=wide_dev[2 + 2 * d],
                slot_mapping=wide_dev[3 + 2 * d],
                query_start_loc=narrow_dev[2 + 2 * d],
                query_start_loc_cpu=torch.from_numpy(qs.astype(np.int32)),
                seq_lens=narrow_dev[3 + 2 * d],
                seq_lens_cpu=torch.from_numpy(sl.astype(np.int32)),
                max_query_len=int(np.diff(qs).max()),
                max_seq_len=int(sl.max()),
            )
        )
    return DraftStepInputs(inputs, wide_dev[1], wide_dev[0], narrow_dev[1])
