"""Tensor helpers whose CPU path differs from their one-pass form."""

from __future__ import annotations

import pytest
import torch
from drafted_trees import drafted_tokens

from vllm_univer import TreeSpec, outcome_law
from vllm_univer.core import ops

pytestmark = pytest.mark.quick


def test_masked_sums_in_chunks_equal_one_pass(monkeypatch):
    """mass_off and excess_off walk the vocabulary in chunks on CPU: the same sums as one
    pass, with listed tokens in any chunk, repeated, or -1."""
    gen = torch.Generator().manual_seed(0)
    a = torch.rand(2, 3, 5000, generator=gen, dtype=torch.float64)
    b = torch.rand(2, 3, 5000, generator=gen, dtype=torch.float64)
    scale = torch.rand(2, 3, 1, generator=gen, dtype=torch.float64)
    mass = torch.rand(2, 3, 1, generator=gen, dtype=torch.float64) + 0.5
    tokens = torch.tensor([1023, 1024, 4999, -1, 1024, 0]).expand(2, 3, -1)
    listed = torch.zeros(2, 3, 5000, dtype=torch.bool)
    listed[..., [0, 1023, 1024, 4999]] = True
    want_off = a.masked_fill(listed, 0).sum(-1, keepdim=True)
    want_excess = (b * scale - a / mass).clamp(min=0).masked_fill(listed, 0).sum(-1, keepdim=True)
    for chunk_elements in (1 << 18, 1):  # one pass; chunks of 1024: four whole, one partial
        monkeypatch.setattr(ops, "_CPU_CHUNK_ELEMENTS", chunk_elements)
        torch.testing.assert_close(ops.mass_off(a, tokens), want_off, rtol=1e-12, atol=0)
        torch.testing.assert_close(ops.excess_off(b, scale, a, mass, tokens), want_excess, rtol=1e-12, atol=0)
    # A view of a level's rows (strided over the batch), no listed token, q_bar = 0 (inf mass).
    none = torch.empty(2, 1, 0, dtype=torch.long)
    torch.testing.assert_close(ops.mass_off(a[:, 1:2], none), a[:, 1:2].sum(-1, keepdim=True), rtol=1e-12, atol=0)
    inf = torch.full((2, 1, 1), float("inf"), dtype=torch.float64)
    got = ops.excess_off(b[:, 1:2], 0.5, a[:, 1:2], inf, none)
    torch.testing.assert_close(got, (b[:, 1:2] * 0.5).sum(-1, keepdim=True), rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_mass_off_a_nearly_whole_set_is_the_tail_itself(dtype):
    """The mass off a set that holds all but 1e-30 of a row is the tail, to the rows'
    rounding (a total minus the set's part gives 0 or noise)."""
    row = torch.zeros(1, 1, 300_000, dtype=dtype)
    row[..., 7] = 1.0
    row[..., 100_000:100_010] = 1e-31
    got = ops.mass_off(row, torch.tensor([[[7]]]))
    assert got.dtype == dtype
    assert got.item() == pytest.approx(1e-30, rel=1e-6, abs=0)
    assert (row.sum(-1) - row[..., 7]).item() != pytest.approx(1e-30, rel=1e-6, abs=0)  # the cancellation avoided


def test_reverse_cumsum_sums_what_is_left():
    x = torch.tensor([[1.0, 1e-30, 2e-30, 0.0]], dtype=torch.float64)
    assert ops.reverse_cumsum(x)[0].tolist() == pytest.approx([1.0, 3e-30, 2e-30, 0.0], rel=1e-15, abs=0)


EAGLE_LIKE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


@pytest.mark.parametrize(
    "method,spec",
    [
        ("univer", "2x2"),
        ("rrs", "3x2"),
        ("rrsw", "3x2"),
        ("traversal", "3x2"),
        ("univer_wor", "3x2"),
        ("univer_wor", EAGLE_LIKE),
    ],
    ids=["univer", "rrs", "rrsw", "traversal", "univer_wor", "univer_wor-eagle-like"],
)
def test_law_is_the_same_with_chunked_vocabulary_passes(monkeypatch, method, spec):
    """The exact outcome law of the verifiers with vocabulary passes (UniVer's sums
    of min, the rejection replays, univer_wor's class sums with floored classes on
    uneven pairs) on a 3000-token vocabulary, in chunks of 1024 and in one pass."""
    from vllm_univer import scheme_for

    tree = TreeSpec.parse(spec) if isinstance(spec, str) else TreeSpec.from_paths(spec)
    gen = torch.Generator().manual_seed(1)
    vocab, n1 = 3000, tree.num_nodes + 1
    q = torch.randn(3, n1, vocab, generator=gen, dtype=torch.float64).mul(4).softmax(-1)
    p = 0.6 * q + 0.4 * torch.randn(3, n1, vocab, generator=gen, dtype=torch.float64).mul(4).softmax(-1)
    tokens = drafted_tokens(tree, q, scheme_for(method), gen)
    one_pass = outcome_law(method, tree, tokens, p, q)
    monkeypatch.setattr(ops, "_CPU_CHUNK_ELEMENTS", 1)
    torch.testing.assert_close(outcome_law(method, tree, tokens, p, q), one_pass, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("chunked", [False, True])
def test_rejection_replay_equals_the_rows_rewritten_step_by_step(monkeypatch, chunked):
    """R <- [a R - c Q]+ then Q(x) <- 0, three times (a token in two rows' last step
    is -1: nothing removed), against rows rewritten in place, in float64: the masses
    (in chunks of 1024 or one pass), the rows written out, and the values at tokens."""
    from vllm_univer.core.verifiers.rejection_replay import RejectionReplay

    if chunked:
        monkeypatch.setattr(ops, "_CPU_CHUNK_ELEMENTS", 1)  # chunks of 1024: four whole, one partial
    gen = torch.Generator().manual_seed(0)
    p = torch.rand(2, 3, 5000, generator=gen, dtype=torch.float64).softmax(-1)
    q = torch.rand(2, 3, 5000, generator=gen, dtype=torch.float64).mul(3).softmax(-1)
    tokens = torch.randint(0, 5000, (2, 3, 3), generator=gen)
    tokens[0, :2, 2] = -1
    for removes in (False, True):
        replay = RejectionReplay(p, q, removes_tokens=removes)
        rows, draft = p.clone(), q.clone()
        for j in range(3):
            x = tokens[..., j : j + 1]
            a = torch.rand(2, 3, 1, generator=gen, dtype=torch.float64) if j == 1 else 1
            c = torch.rand(2, 3, 1, generator=gen, dtype=torch.float64) * 2
            replay.reject(a, c, x)
            rows = (a * rows - c * draft).clamp(min=0)
            if removes:
                draft.scatter_(-1, x.clamp(min=0), draft.gather(-1, x.clamp(min=0)) * (x < 0))
            out = torch.full_like(p, float("nan"))
            r_mass, q_mass = replay.masses(out=out)
            torch.testing.assert_close(out, rows, rtol=1e-12, atol=1e-18)
            torch.testing.assert_close(r_mass, rows.sum(-1, keepdim=True), rtol=1e-12, atol=1e-18)
            if removes:
                torch.testing.assert_close(q_mass, draft.sum(-1, keepdim=True), rtol=1e-12, atol=0)
            else:
                assert q_mass is None
            at_rows, at_draft = replay.at(tokens)
            valid = tokens >= 0
            torch.testing.assert_close(
                at_rows[valid], rows.gather(-1, tokens.clamp(min=0))[valid], rtol=1e-12, atol=1e-18
            )
            torch.testing.assert_close(at_draft[valid], draft.gather(-1, tokens.clamp(min=0))[valid], rtol=0, atol=0)


def test_safe_ratio_is_finite():
    num = torch.tensor([1.0, 0.0, 2.0, 3e38, 1.0])
    den = torch.tensor([4.0, 0.0, 0.0, 1e-3, 1e-45])
    ratio = ops.safe_ratio(num, den)
    assert torch.isfinite(ratio).all()
    assert ratio.tolist()[:3] == [0.25, 0.0, 0.0]
    assert ratio[3] == torch.finfo(torch.float32).max and ratio[4] == torch.finfo(torch.float32).max


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_clipped_ratio_edge_cases(dtype):
    # x/0 = 1 and 0/0 = 0, also for a zero of either sign or a den rounded below 0;
    # ratios above 1 clip; tiny dens do not overflow into anything but 1.
    num = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 3.0, 1.0, 0.5, 1e-30], dtype=dtype)
    den = torch.tensor([0.0, 0.0, -0.0, -0.0, -1e-17, -1e-17, 2.0, 1e-45, 1.0, 1.0], dtype=dtype)
    ratio = ops.clipped_ratio(num, den)
    expected = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.5, 1e-30], dtype=dtype)
    assert torch.equal(ratio, expected)


def test_verifiers_leave_their_inputs_untouched():
    """Node rules work on copies: p and q are the caller's (in the engine, vLLM's rows)."""
    from vllm_univer import METHODS, scheme_for, verify

    tree = TreeSpec.parse("2x2")
    gen = torch.Generator().manual_seed(2)
    n1, vocab = tree.num_nodes + 1, 50
    q = torch.randn(4, n1, vocab, generator=gen).mul(3).softmax(-1)
    p = torch.randn(4, n1, vocab, generator=gen).mul(3).softmax(-1)
    for method in METHODS:
        if method in ("token", "block"):
            continue  # chain-only
        tokens = drafted_tokens(tree, q, scheme_for(method), gen)
        p0, q0 = p.clone(), q.clone()
        verify(method, tree, tokens, p, q, generator=torch.Generator().manual_seed(0))
        assert torch.equal(p, p0) and torch.equal(q, q0), method
