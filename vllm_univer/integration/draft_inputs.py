"""The draft forwards' inputs of one step, built without reading this step's
sampled tokens on the host.

Where each request's tree is rooted depends on how many tokens the step's
verification accepted, known on the device only. Reading it (or the sampled
tokens) before drafting would make the host wait for the verification to finish,
and the GPU idle while the host then built the drafter's inputs. Instead every
input is laid out on the host as if nothing had been accepted, and moved on the
device by each request's shift ``s`` (its new tokens but one):

* level 0 runs positions ``start + s .. committed + s`` causally: the committed
  tokens whose draft KV is missing, then the new root. A request whose tree was
  verified this step runs its last two tokens (the node below the root, in case
  the path ended on a leaf the drafter never ran, and the root): its draft KV
  holds the context, the old root and every accepted node the drafter ran;
* level d >= 1 runs the nodes of depth d at RoPE position root + d, slot root + node.

The host knows a bound on each shift (the verified tree's depth), enough for the
sizes vLLM's attention metadata reads on the host (``seq_lens_cpu`` is then an
upper bound, as vLLM's own metadata is under async speculative decoding).
Everything reaches the device in two copies (one int64, one int32).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from ..core.fused_tree_pass import triton_reads
from .host_to_device import upload_packed


class DraftRoots(NamedTuple):
    """Where the active requests' trees are rooted, R requests.

    start: int64 [R], the first position level 0 runs before the shift;
    committed: int64 [R], tokens committed before this step's new ones (positions
        < committed hold them on the host);
    max_new: int64 [R] >= 1, a host bound on the step's new tokens;
    committed_tokens: per request the tokens at positions start .. committed-1;
    new_tokens: [R, W] the step's new tokens (accepted path and bonus, -1 padded),
        on the device; new_counts: [R] how many (``new_token_counts``), on the device.
    """

    start: np.ndarray
    committed: np.ndarray
    max_new: np.ndarray
    committed_tokens: list[list[int]]
    new_tokens: torch.Tensor
    new_counts: torch.Tensor

    @property
    def root_bound(self) -> np.ndarray:
        """int64 [R]: a bound on each root's position (committed + new tokens - 1)."""
        return self.committed + self.max_new - 1


class LevelInputs(NamedTuple):
    """One draft forward's flat batch of T query tokens over R requests.

    token_ids: LongTensor [T] on the device (level 0; None for deeper levels,
        whose tokens are the drafted nodes, already on the device).
    positions: LongTensor [T], RoPE positions; slot_mapping: LongTensor [T],
        the cache slot each token's key/value is written to.
    query_start_loc / query_start_loc_cpu: IntTensor [R+1] on the device / host.
    seq_lens: IntTensor [R] on the device, keys each request's last query sees;
    seq_lens_cpu: IntTensor [R], an upper bound on them on the host.
    max_query_len, max_seq_len (an upper bound): Python ints.
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
    the cached tokens every tree node sees); block_table: IntTensor [R, blocks];
    root_rows: LongTensor [R], each root's row in level 0's flat batch (all on the device)."""

    levels: list[LevelInputs]
    root_tokens: torch.Tensor
    context_lens: torch.Tensor
    block_table: torch.Tensor
    root_rows: torch.Tensor


class HostLayout(NamedTuple):
    """Every draft forward's inputs before the shift (as if nothing had been
    accepted), on the device. T rows (every forward's, level 0's first), S keys
    entries (one per request of each forward), num0 level-0 rows, R requests.

    rows, row_base: int64 [T], each row's request and its offset in ``table``;
    positions, slot_positions: int64 [T], RoPE and cache positions;
    table: int64 [R * blocks], the flat block table;
    seq_rows: int64 [S], each entry's request; seq_lens: int32 [S], keys it sees;
    tokens: int64 [num0 + pad], level 0's committed tokens (padded past the end);
    index: int64 [num0] (0 .. num0-1); neg_rel: int64 [num0], committed - position;
    new_index: int64 [num0], where a row's position falls among the flat new tokens
        (valid only where some shift reaches them);
    root_rows: int64 [R], each root's level-0 row; committed: int64 [R];
    bound: int32 [R], the host's bound on each shift (``max_new - 1``).
    """

    rows: torch.Tensor
    row_base: torch.Tensor
    positions: torch.Tensor
    slot_positions: torch.Tensor
    table: torch.Tensor
    seq_rows: torch.Tensor
    seq_lens: torch.Tensor
    tokens: torch.Tensor
    index: torch.Tensor
    neg_rel: torch.Tensor
    new_index: torch.Tensor
    root_rows: torch.Tensor
    committed: torch.Tensor
    bound: torch.Tensor


class PlacedInputs(NamedTuple):
    """``HostLayout`` moved by the shifts: positions, slot_mapping int64 [T];
    seq_lens int32 [S]; token_ids int64 [num0] (level 0's); root_tokens,
    context_lens int64 [R] (context_lens: the root positions)."""

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    token_ids: torch.Tensor
    root_tokens: torch.Tensor
    context_lens: torch.Tensor


def new_token_counts(new_tokens: torch.Tensor) -> torch.Tensor:
    """int32 [R]: the new tokens of each row of ``new_tokens`` [R, W] (-1 padded), on its device."""
    return (new_tokens >= 0).sum(1, dtype=torch.int32)


def build_draft_step_inputs(
    roots: DraftRoots,
    level_span: list[tuple[int, int]],
    depth: int,
    block_rows: torch.Tensor,
    block_size: int,
    device: torch.device,
    level_reqs: list[int] | None = None,
) -> DraftStepInputs:
    """Inputs of the ``depth`` draft forwards of one step.

    roots: the requests' level-0 facts (``DraftRoots``); level_span[d]: (first, last)
    node of depth d; block_rows: the requests' block-table rows, int32 [R, blocks],
    on the host. Level d >= 1 runs nodes first..last of the first ``level_reqs[d]``
    requests (None: of every request; requests cut shallower come last and drop out).
    The shift of a row is clamped to its bound ``max_new - 1`` (a bound that did
    not hold would only root the tree elsewhere, never write past the request's blocks).
    """
    reqs = len(roots.committed)
    level_reqs = level_reqs or [reqs] * depth
    start, committed = roots.start, roots.committed
    root_bound = roots.root_bound
    lens = committed - start + 1
    query_start0 = np.concatenate([[0], np.cumsum(lens)])
    num0 = int(query_start0[-1])
    row0 = np.repeat(np.arange(reqs), lens)
    pos0 = np.repeat(start, lens) + np.arange(num0) - np.repeat(query_start0[:-1], lens)
    # Level 0's tokens before the shift: committed ones, the root's row a placeholder.
    host_tokens = np.zeros(num0, dtype=np.int64)
    for r, chunk in enumerate(roots.committed_tokens):
        host_tokens[query_start0[r] : query_start0[r] + len(chunk)] = chunk

    # Per forward: (rows' requests, RoPE positions, slot positions, query starts,
    # requests, keys seen before the shift, their bound), all before the shift.
    forwards = [(row0, pos0, pos0, query_start0, np.arange(reqs), committed + 1, root_bound + 1)]
    for d in range(1, depth):
        first, last = level_span[d]
        width, n = last - first + 1, level_reqs[d]
        rows = np.repeat(np.arange(n), width)
        forwards.append(
            (
                rows,
                committed[rows] + d,
                (committed[:n, None] + np.arange(first, last + 1)[None]).ravel(),
                np.arange(n + 1) * width,
                np.arange(n),
                committed[:n] + last + 1,
                root_bound[:n] + last + 1,
            )
        )
    width = roots.new_tokens.shape[1]
    table = block_rows.numpy()
    blocks = table.shape[1]
    # Level 0's row of position p (before the shift) holds position p + s: a committed
    # token while p + s < committed (s host rows on; the host tokens padded so that
    # stays in range), else new token p + s - committed. Its flat index is >= -(W-1)
    # (an index from the end, unused, in row 0) and 0 where no shift reaches the new tokens.
    rel0 = pos0 - committed[row0]
    host_tokens = np.concatenate([host_tokens, np.zeros(int(roots.max_new.max()), dtype=np.int64)])
    new_index0 = np.where(rel0 + roots.max_new[row0] > 0, row0 * width + rel0, 0)
    # Each of rows, positions, slot positions, keys' requests: every forward's, concatenated.
    rows_all, pos_all, slot_pos_all, seq_rows_all = (np.concatenate([f[i] for f in forwards]) for i in (0, 1, 2, 4))
    wide = [committed, host_tokens, np.arange(num0), -rel0, new_index0, query_start0[1:] - 1, table]
    wide += [rows_all, rows_all * blocks, pos_all, slot_pos_all, seq_rows_all]
    # int32: what vLLM's metadata reads as int32, and what is added to the int32 shift.
    narrow = [table, roots.max_new - 1, np.concatenate([f[5] for f in forwards])] + [f[3] for f in forwards]
    wide_dev = upload_packed(wide, device, torch.int64)
    narrow_dev = upload_packed(narrow, device, torch.int32)
    committed_dev, tokens_dev, index0, neg_rel0, new_index0, root_rows, table64 = wide_dev[:7]
    rows_all, row_base, pos_all, slot_pos_all, seq_rows_all = wide_dev[7:]
    table_dev, bound_dev, seq_all = narrow_dev[:3]
    layout = HostLayout(
        rows_all, row_base, pos_all, slot_pos_all, table64.reshape(-1), seq_rows_all, seq_all,
        tokens_dev, index0, neg_rel0, new_index0, root_rows, committed_dev, bound_dev,
    )  # fmt: skip
    placed = place_draft_inputs(layout, roots.new_tokens, roots.new_counts, block_size)

    inputs = []
    row_counts = [len(f[0]) for f in forwards]
    req_counts = [len(f[4]) for f in forwards]
    pos_split = placed.positions.split(row_counts)
    slot_split = placed.slot_mapping.split(row_counts)
    seq_split = placed.seq_lens.split(req_counts)
    for d, (_, _, _, qs, _, _, seq_bound) in enumerate(forwards):
        inputs.append(
            LevelInputs(
                token_ids=placed.token_ids if d == 0 else None,
                positions=pos_split[d],
                slot_mapping=slot_split[d],
                query_start_loc=narrow_dev[3 + d],
                query_start_loc_cpu=torch.from_numpy(qs.astype(np.int32)),
                seq_lens=seq_split[d],
                seq_lens_cpu=torch.from_numpy(seq_bound.astype(np.int32)),
                max_query_len=int(np.diff(qs).max()),
                max_seq_len=int(seq_bound.max()),
            )
        )
    return DraftStepInputs(inputs, placed.root_tokens, placed.context_lens, table_dev, root_rows)


def place_draft_inputs(
    layout: HostLayout, new_tokens: torch.Tensor, new_counts: torch.Tensor, block_size: int
) -> PlacedInputs:
    """Move the step's host layout by each request's shift, on the device.

    layout: ``HostLayout`` (uploaded); new_tokens: [R, W] int64 (-1 padded) and
    new_counts: [R] int32, this step's sampled tokens (never read on the host).
    Shift of request r: clamp(min(new_counts[r] - 1, bound[r]), 0). On CUDA one
    Triton launch (``triton_draft_inputs``); here ~20 ATen ops.
    """
    if triton_reads(new_tokens):
        from .triton_draft_inputs import place_draft_inputs_fused

        return place_draft_inputs_fused(layout, new_tokens, new_counts, block_size)
    shift = torch.minimum(new_counts - 1, layout.bound).clamp_(min=0)
    # Every forward's rows at once: positions, slots and keys seen, moved by the shift.
    row_shift = shift[layout.rows]
    slot_pos = layout.slot_positions + row_shift
    slots = layout.table[layout.row_base + slot_pos // block_size] * block_size
    slots += slot_pos % block_size
    seq_lens = layout.seq_lens + shift[layout.seq_rows]
    # Level 0's rows come first. A row takes the new token at rel + s where that is
    # >= 0 (-1 there: a request without one, read as 0), else the committed one s rows on.
    s0 = row_shift[: layout.neg_rel.numel()]
    new = new_tokens.reshape(-1)[layout.new_index + s0]
    old = layout.tokens[layout.index + s0]
    token_ids = torch.where(s0 >= layout.neg_rel, new, old).clamp_(min=0)
    return PlacedInputs(
        layout.positions + row_shift,
        slots,
        seq_lens,
        token_ids,
        token_ids[layout.root_rows],
        layout.committed + shift,
    )


def build_catch_up_inputs(
    start: np.ndarray, tokens: list[list[int]], block_rows: torch.Tensor, block_size: int, device: torch.device
) -> tuple[torch.Tensor, LevelInputs, torch.Tensor]:
    """A causal draft forward over committed tokens whose draft KV is missing (a
    chunk of a catch-up, ``TreeDrafter.propose``): request r runs ``tokens[r]``
    at positions ``start[r]`` on, after the ``start[r]`` tokens already in its draft
    KV. Every input is known on the host: nothing waits for the step's sampling.
    Returns (token_ids [T], the forward's ``LevelInputs``, block_table int32 [R, blocks]),
    on ``device``."""
    lens = np.array([len(t) for t in tokens], dtype=np.int64)
    query_start = np.concatenate([[0], np.cumsum(lens)])
    rows = np.repeat(np.arange(len(lens)), lens)
    positions = np.repeat(start, lens) + np.arange(int(query_start[-1])) - np.repeat(query_start[:-1], lens)
    table = block_rows.numpy().astype(np.int64)
    slots = table[rows, positions // block_size] * block_size + positions % block_size
    seq_lens = start + lens
    token_ids, positions_dev, slots_dev = upload_packed(
        [np.concatenate(tokens).astype(np.int64), positions, slots], device, torch.int64
    )
    query_start_dev, seq_lens_dev, table_dev = upload_packed([query_start, seq_lens, table], device, torch.int32)
    level = LevelInputs(
        token_ids=token_ids,
        positions=positions_dev,
        slot_mapping=slots_dev,
        query_start_loc=query_start_dev,
        query_start_loc_cpu=torch.from_numpy(query_start.astype(np.int32)),
        seq_lens=seq_lens_dev,
        seq_lens_cpu=torch.from_numpy(seq_lens.astype(np.int32)),
        max_query_len=int(lens.max()),
        max_seq_len=int(seq_lens.max()),
    )
    return token_ids, level, table_dev
