"""``draft_children`` draws children with exactly the scheme's law (seeded chi-square)."""

import numpy as np
import pytest
import torch

from vllm_univer import draft_children
from vllm_univer.tools.goodness_of_fit import chi_square_pvalue
from vllm_univer.tools.law_oracle import scheme_outcomes

pytestmark = pytest.mark.quick

ROWS = [
    [0.4, 0.3, 0.2, 0.1, 0.0],
    [0.25, 0.25, 0.25, 0.25, 0.0],  # ties: topk1 takes the lower ids first
    [0.0, 0.5, 0.0, 0.5, 0.0],  # support smaller than the children
    [0.7, 0.1, 0.1, 0.05, 0.05],
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize(
    "scheme,m", [("chain", 1), ("iid", 2), ("iid", 3), ("wor", 2), ("wor", 3), ("topk1", 1), ("topk1", 2), ("topk1", 3)]
)
@pytest.mark.parametrize("row", range(len(ROWS)))
@pytest.mark.parametrize("block", [1024, 2], ids=["one_block", "blocks_of_2"])
def test_children_law(scheme, m, row, dtype, block, monkeypatch):
    # Blocks of 2 tokens: drawn and top tokens fall in different inverse-CDF blocks.
    monkeypatch.setattr("vllm_univer.core.inverse_cdf.DEFAULT_BLOCK", block)
    q = np.array(ROWS[row])
    outcomes = {xs: pr for xs, pr in scheme_outcomes(scheme, q, m)}
    draws = 8000
    gen = torch.Generator().manual_seed(17 + row)
    kids = draft_children(scheme, torch.tensor(q, dtype=dtype).expand(draws, -1).contiguous(), m, generator=gen)
    assert kids.shape == (draws, m) and kids.dtype == torch.long
    seen: dict[tuple, int] = {}
    for xs in map(tuple, kids.tolist()):
        assert xs in outcomes, f"{scheme} drew {xs}, which has probability 0"
        seen[xs] = seen.get(xs, 0) + 1
    keys = list(outcomes)
    counts = np.array([seen.get(k, 0) for k in keys])
    assert chi_square_pvalue(counts, np.array([outcomes[k] for k in keys])) > 1e-4


def test_topk1_ties_go_to_lower_ids_and_empty_residual_is_missing():
    q = torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.2, 0.3, 0.3, 0.2]])
    kids = draft_children("topk1", q, 3, generator=torch.Generator().manual_seed(0))
    assert kids[0].tolist() == [-1, 1, 3]  # top-2 = {1, 3} holds all mass: slot 0 missing
    assert kids[1, 1:].tolist() == [1, 2]  # tie 0.3/0.3 -> ids 1, 2
    assert kids[1, 0].item() in (0, 3)


@pytest.mark.parametrize("scheme,m", [("iid", 2), ("wor", 3), ("topk1", 3)])
def test_children_of_a_strided_view_equal_those_of_its_rows(scheme, m):
    """A [R, K, V] slice of a kept buffer (not contiguous) gives, with the same seed,
    the children of the same rows made contiguous, and is not written to."""
    gen = torch.Generator().manual_seed(3)
    buffer = torch.rand(3, 7, 2500, generator=gen) ** 8
    view = buffer[:, 2:6]
    before = buffer.clone()
    kids = draft_children(scheme, view, m, generator=torch.Generator().manual_seed(5))
    flat = draft_children(scheme, view.reshape(-1, 2500), m, generator=torch.Generator().manual_seed(5))
    assert kids.shape == (3, 4, m)
    assert torch.equal(kids.flatten(0, 1), flat)
    assert torch.equal(buffer, before)


def test_bad_arguments():
    q = torch.full((2, 4), 0.25)
    with pytest.raises(ValueError, match="unknown draft scheme"):
        draft_children("beam", q, 2)
    with pytest.raises(ValueError, match="exactly one child"):
        draft_children("chain", q, 2)
    with pytest.raises(ValueError, match="distinct children"):
        draft_children("wor", q, 5)
    with pytest.raises(ValueError, match=r"\[K, V\]"):
        draft_children("iid", q[0], 2)
    with pytest.raises(ValueError, match=r"\[K, V\]"):
        draft_children("iid", q.view(1, 1, 2, 4), 2)


def test_top_tokens_order_equals_a_stable_sort_with_heavy_ties():
    from vllm_univer.core.drafting import top_tokens

    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        vocab = int(torch.randint(2, 30, (1,), generator=gen))
        k = int(torch.randint(1, vocab + 1, (1,), generator=gen))
        probs = torch.randint(0, 4, (5, vocab), generator=gen).float()  # many equal values
        expected = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :k]
        assert torch.equal(top_tokens(probs, k), expected)


def test_top_tokens_fast_path_equals_the_exact_rule_on_ties():
    """The topk(k+1) fast path and argmax (k = 1) give exactly the full-width rule
    (rank by value, ties to the lower id), including ties across the k-th place."""
    from vllm_univer.core.drafting import _top_tokens_exact, top_tokens

    gen = torch.Generator().manual_seed(0)
    for _ in range(500):
        vocab = int(torch.randint(2, 8, (1,), generator=gen))
        probs = torch.randint(0, 3, (5, vocab), generator=gen).float()
        for k in range(1, vocab + 1):
            assert torch.equal(top_tokens(probs, k), _top_tokens_exact(probs, k)), (probs, k)
