"""Tree rows get exactly the distribution vLLM's own Sampler draws from."""

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")
from vllm.v1.sample.logits_processor import LogitsProcessors  # noqa: E402
from vllm.v1.sample.metadata import SamplingMetadata  # noqa: E402
from vllm.v1.sample.sampler import Sampler  # noqa: E402

from law_utils import chi_square_pvalue  # noqa: E402
from vllm_univer.integration.target_probs import tree_target_probs  # noqa: E402


def _metadata(temperature, top_k, top_p):
    n = len(temperature)
    return SamplingMetadata(
        temperature=temperature, all_greedy=bool((temperature == 0).all()), all_random=bool((temperature > 0).all()),
        top_p=top_p, top_k=top_k, generators={}, max_num_logprobs=None, no_penalties=True,
        prompt_token_ids=None, frequency_penalties=torch.zeros(n), presence_penalties=torch.zeros(n),
        repetition_penalties=torch.ones(n), output_token_ids=[[] for _ in range(n)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())


def test_tree_rows_match_vllm_sampler_law():
    vocab, rows = 24, 3
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, rows, vocab, generator=gen) * 2
    temperature = torch.tensor([1.0, 0.7, 1.3, 0.0])
    top_k = torch.tensor([vocab, 5, vocab, vocab])
    top_p = torch.tensor([1.0, 1.0, 0.8, 1.0])
    probs, greedy = tree_target_probs(logits, temperature, top_k, top_p)
    assert greedy.tolist() == [False, False, False, True]
    assert torch.allclose(probs.sum(-1), torch.ones(4, rows))

    # vLLM's Sampler, one row per request and node, many times over.
    draws = 4000
    flat = logits.reshape(-1, vocab).repeat(draws, 1)
    req = torch.arange(4).repeat_interleave(rows).repeat(draws)
    sampler = Sampler()
    out = sampler(flat.clone(), _metadata(temperature[req], top_k[req], top_p[req])).sampled_token_ids.flatten()
    out = out.view(draws, 4 * rows)
    for r in range(4 * rows):
        b, node = divmod(r, rows)
        counts = np.bincount(out[:, r].numpy(), minlength=vocab)
        expected = probs[b, node].double().numpy()
        if greedy[b]:
            assert (counts == draws * (np.arange(vocab) == logits[b, node].argmax().item())).all()
            continue
        assert counts[expected == 0].sum() == 0, "vLLM drew a token we give probability 0"
        assert chi_square_pvalue(counts, expected / expected.sum()) > 1e-4, (b, node)


@pytest.mark.parametrize("change,match", [
    ({"no_penalties": False}, "penalties"),
    ({"bad_words_token_ids": {0: [[1]]}}, "bad_words"),
    ({"allowed_token_ids_mask": torch.zeros(1, 4, dtype=torch.bool)}, "allowed_token_ids"),
])
def test_options_that_depend_on_the_path_are_refused(change, match):
    from dataclasses import replace

    from vllm_univer.integration.target_probs import check_supported

    meta = _metadata(torch.ones(1), None, None)
    check_supported(meta)
    with pytest.raises(ValueError, match=match):
        check_supported(replace(meta, **change))
