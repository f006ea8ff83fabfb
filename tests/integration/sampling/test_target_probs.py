"""Tree rows get exactly the distribution vLLM's own Sampler draws from."""

import math

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")
from vllm.v1.sample.logits_processor import LogitsProcessors  # noqa: E402
from vllm.v1.sample.metadata import SamplingMetadata  # noqa: E402
from vllm.v1.sample.sampler import Sampler  # noqa: E402

from vllm_univer.integration.sampling.target_probs import tree_target_probs  # noqa: E402
from vllm_univer.tools.goodness_of_fit import chi_square_pvalue  # noqa: E402


def _metadata(temperature, top_k, top_p):
    n = len(temperature)
    return SamplingMetadata(
        temperature=temperature,
        all_greedy=bool((temperature == 0).all()),
        all_random=bool((temperature > 0).all()),
        top_p=top_p,
        top_k=top_k,
        generators={},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(n),
        presence_penalties=torch.zeros(n),
        repetition_penalties=torch.ones(n),
        output_token_ids=[[] for _ in range(n)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


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


def test_tree_penalties_equal_vllm_penalties_on_each_path():
    """Every tree row gets vLLM's own penalties for the text it continues: the
    request's generated tokens plus the tokens on the path to the node."""
    from dataclasses import replace

    from vllm.v1.sample.ops.penalties import apply_all_penalties

    from vllm_univer import TreeSpec
    from vllm_univer.integration.sampling.target_probs import TreePenalties

    vocab, tree = 20, TreeSpec.parse([[0], [1], [0, 0], [0, 1], [1, 0]])
    gen = torch.Generator().manual_seed(1)
    rows = tree.num_nodes + 1
    logits = torch.randn(2, rows, vocab, generator=gen) * 2
    tokens = torch.randint(0, vocab, (2, rows), generator=gen)
    tokens[1, 5] = -1  # a node that does not exist
    meta = replace(
        _metadata(torch.ones(2), None, None),
        no_penalties=False,
        prompt_token_ids=torch.tensor([[3, 4, 5, vocab], [6, 6, 7, 8]]),
        presence_penalties=torch.tensor([0.5, 0.0]),
        frequency_penalties=torch.tensor([0.3, 0.7]),
        repetition_penalties=torch.tensor([1.3, 1.1]),
        output_token_ids=[[4, 9, 9], []],
    )
    ours = logits.clone()
    TreePenalties(tree.on(tokens.device).token_paths(tokens), meta, 2).apply(ours)
    for b in range(2):
        for node in range(rows):
            path = [int(tokens[b, a]) for a in tree.ancestors[node].tolist() if a >= 0 and tokens[b, a] >= 0]
            expected = apply_all_penalties(
                logits[b, node].clone().unsqueeze(0),
                meta.prompt_token_ids[b : b + 1],
                meta.presence_penalties[b : b + 1],
                meta.frequency_penalties[b : b + 1],
                meta.repetition_penalties[b : b + 1],
                [meta.output_token_ids[b] + path],
            )
            torch.testing.assert_close(ours[b, node], expected[0])


def test_options_that_depend_on_the_path_are_refused():
    """Every per-path option is honoured; structured outputs too, unless the grammar
    starts only where a reasoning parser sees the reasoning end; a thinking-token
    budget (counted per path) is refused."""
    from vllm import SamplingParams
    from vllm.config import StructuredOutputsConfig
    from vllm.sampling_params import StructuredOutputsParams

    from vllm_univer.integration.sampling.request_options import unsupported_option

    honoured = SamplingParams(
        temperature=0.5,
        top_p=0.9,
        presence_penalty=0.4,
        seed=3,
        bad_words=["x"],
        allowed_token_ids=[1, 2],
        min_tokens=2,
    )
    structured = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
    assert unsupported_option(honoured) is None
    assert unsupported_option(structured, StructuredOutputsConfig()) is None
    assert (
        unsupported_option(
            structured, StructuredOutputsConfig(reasoning_parser="deepseek_r1", enable_in_reasoning=True)
        )
        is None
    )
    assert unsupported_option(honoured, StructuredOutputsConfig(reasoning_parser="deepseek_r1")) is None
    parameter, message = unsupported_option(structured, StructuredOutputsConfig(reasoning_parser="deepseek_r1"))
    assert parameter == "structured_outputs" and "reasoning parser" in message
    parameter, message = unsupported_option(SamplingParams(thinking_token_budget=16))
    assert parameter == "thinking_token_budget" and "differs between tree paths" in message


def test_path_masks_equal_vllm_on_each_path():
    """Allowed tokens, bad words and min_tokens on every tree row equal vLLM's own
    treatment of the one row it samples, whose output is the request's output
    followed by the path to the node."""
    from dataclasses import replace

    from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor
    from vllm.v1.sample.ops.bad_words import apply_bad_words

    from vllm_univer import TreeSpec
    from vllm_univer.integration.sampling.path_masks import TreePathMasks

    vocab, tree = 12, TreeSpec.parse([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [1, 0, 0]])
    rows = tree.num_nodes + 1
    gen = torch.Generator().manual_seed(2)
    batch = 4
    logits = torch.randn(batch, rows, vocab, generator=gen)
    # Small vocabulary, repeated tokens: bad-word prefixes match on some paths and not others.
    tokens = torch.randint(0, 4, (batch, rows), generator=gen)
    tokens[3, 7] = -1  # a node that does not exist
    outputs = [[1, 2], [], [3, 3, 1], [0]]
    bad_words = {0: [[2, 1], [5]], 1: [[0, 1, 2]], 3: [[0, 2, 3], [1, 1]]}
    allowed = torch.zeros(batch, vocab, dtype=torch.bool)
    allowed[2, 8:] = True  # request 2 may not use tokens 8..11
    min_tokens = MinTokensLogitsProcessor(None, torch.device("cpu"), False)
    min_tokens.min_toks = {1: (2, outputs[1], {9, 10}, False), 2: (5, outputs[2], {11}, False)}
    meta = replace(
        _metadata(torch.ones(batch), None, None),
        output_token_ids=outputs,
        bad_words_token_ids=bad_words,
        allowed_token_ids_mask=allowed,
        logitsprocs=LogitsProcessors([min_tokens]),
    )
    assert TreePathMasks.needed(meta)
    ours = logits.clone()
    TreePathMasks(tree.on(tokens.device).token_paths(tokens), tree.depth, meta, batch).apply(ours)

    stops = {b: (state[0], state[2]) for b, state in min_tokens.min_toks.items()}
    banned_somewhere = 0
    for b in range(batch):
        for node in range(rows):
            path = [int(tokens[b, a]) for a in tree.ancestors[node].tolist() if a >= 0]
            if any(t < 0 for t in path):
                continue  # the row of a node that does not exist is never read
            past = outputs[b] + path
            expected = logits[b, node].clone().unsqueeze(0)
            expected.masked_fill_(allowed[b : b + 1], float("-inf"))
            apply_bad_words(expected, {0: bad_words[b]} if b in bad_words else {}, [past])
            if b in stops and len(past) < stops[b][0]:
                expected[0, sorted(stops[b][1])] = float("-inf")
            torch.testing.assert_close(ours[b, node], expected[0])
            banned_somewhere += int(torch.isinf(expected).sum())
    assert banned_somewhere > 20  # the bans do bite on this tree


def test_logit_bias_and_min_p_on_every_row():
    """logit_bias added to every row of its request (before penalties), min_p after
    temperature: tree_target_probs equals the law written out in float64."""
    from types import SimpleNamespace

    from vllm_univer.integration.sampling.bias_and_min_p import RequestBiasAndMinP
    from vllm_univer.integration.sampling.target_probs import tree_target_probs

    gen = torch.Generator().manual_seed(3)
    batch, rows, vocab = 3, 4, 12
    logits = torch.randn(batch, rows, vocab, generator=gen) * 3
    params = {
        "a": SimpleNamespace(logit_bias={2: 1.5, 7: -2.0}, min_p=0.0),
        "b": SimpleNamespace(logit_bias=None, min_p=0.2),
        "c": SimpleNamespace(logit_bias={0: 4.0}, min_p=0.05),
    }
    options = RequestBiasAndMinP()
    options.update(["a", "b", "c"], params.__getitem__, torch.device("cpu"))
    temperature = torch.tensor([0.7, 1.0, 1.3])
    probs, _ = tree_target_probs(logits, temperature, path_transforms=[options.logit_bias()], min_p=options.min_p)

    for b, req in enumerate("abc"):
        row_logits = logits[b].double().clone()
        for token, bias in (params[req].logit_bias or {}).items():
            row_logits[:, token] += bias
        expected = (row_logits / float(temperature[b])).softmax(-1)
        keep = expected >= params[req].min_p * expected.amax(-1, keepdim=True)
        expected = torch.where(keep, expected, torch.zeros_like(expected))
        expected /= expected.sum(-1, keepdim=True)
        torch.testing.assert_close(probs[b].double(), expected, rtol=1e-5, atol=1e-6)

    # Rebuilt only when the batch's requests change: a reordered batch gets reordered values.
    options.update(["c", "a", "b"], params.__getitem__, torch.device("cpu"))
    assert torch.equal(options.min_p, torch.tensor([0.05, 0.0, 0.2]))
    assert options.logit_bias().rows.tolist() == [0, 1, 1]
    options.update(["b"], params.__getitem__, torch.device("cpu"))
    assert options.logit_bias() is None


def test_softmax_in_place_equals_torch_softmax():
    """``softmax_`` writes torch.softmax's values into its input: exactly for a
    whole buffer (the target rows), closely for a strided view of one (the
    drafter's level rows, on the three-step path); -inf-masked tokens get 0."""
    from vllm_univer.integration.sampling.target_probs import softmax_

    gen = torch.Generator().manual_seed(0)
    buffer = torch.randn(3, 6, 5000, generator=gen) * 4
    buffer[0, 1, :4000] = float("-inf")
    expected = torch.softmax(buffer, -1)
    view_expected = expected[:, 2:5].clone()
    whole = buffer.clone()
    assert softmax_(whole) is whole and torch.equal(whole, expected)
    untouched = buffer[:, [0, 1, 5]].clone()
    softmax_(buffer[:, 2:5])
    # The strided path (sub_, exp_, sum, div_) and ATen's fused kernel round
    # differently, not wrongly. Per entry, relative to float32's eps: each exp is
    # within 2 ulps of exact (vectorised and scalar exp alike), each division
    # within 0.5, and each path's row sum of n = 5000 terms, summed in lanes and
    # then across them, within ceil(log2 n) = 13 ulps of the exact sum: 2 * (2 +
    # 0.5 + 13) = 31 ulps between the two paths. Measured: 1.6e-6 (13 ulps) on an
    # AVX2 EPYC. Entries below float32's smallest normal lose relative precision.
    eps = torch.finfo(torch.float32).eps
    ulps = 2 * (2 + 0.5 + math.ceil(math.log2(buffer.shape[-1])))
    torch.testing.assert_close(buffer[:, 2:5], view_expected, rtol=ulps * eps, atol=torch.finfo(torch.float32).tiny)
    assert torch.equal(buffer[:, [0, 1, 5]], untouched)
    assert (whole[0, 1, :4000] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_target_probs_into_a_kept_buffer(dtype):
    """Probabilities computed into the sampler's kept buffer (temperature and the
    copy in one pass) equal those computed in a fresh tensor."""
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(3, 4, 300, generator=gen) * 3).to(dtype)
    temperature, top_k, top_p = torch.tensor([0.6, 0.0, 1.4]), torch.tensor([300, 300, 7]), torch.tensor([0.9, 1, 1])
    fresh, greedy = tree_target_probs(logits, temperature, top_k, top_p)
    buffer = torch.full((3, 4, 300), float("nan"))
    kept, greedy_kept = tree_target_probs(logits, temperature, top_k, top_p, out=buffer)
    assert kept.data_ptr() == buffer.data_ptr()
    assert torch.equal(kept, fresh) and torch.equal(greedy, greedy_kept)
