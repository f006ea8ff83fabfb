"""Tree speculation inside vLLM's engine (CPU build), end to end, on tiny random models.

Every engine runs in a fresh subprocess (``engine_job.run_engines``).
"""

from __future__ import annotations

import json
import math
import random

import pytest

pytest.importorskip("vllm")

from engine_job import run_engines  # noqa: E402
from greedy_identity import LOGPROB_ROUNDING, assert_greedy_identical, compared_length, truncated  # noqa: E402
from tiny_models import WORDS  # noqa: E402

IRREGULAR = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]]
GREEDY_CASES = [
    ("univer", "1x5"),
    ("univer", "2x3"),
    ("univer", "3x2"),
    ("univer", IRREGULAR),
    ("greedy", "2x3"),
    ("rrs", "3x2"),
    ("rrsw", IRREGULAR),
    ("traversal", "2x3"),
    ("univer_wor", "3x2"),
    ("target_only", "2x2"),
    ("token", "1x5"),
    ("block", "1x5"),
]


@pytest.fixture(scope="module")
def models(tiny_pair):
    return tiny_pair


def prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 60))) for _ in range(n)]


def univer(draft: str, tree, verifier: str = "univer") -> dict:
    return {"method": "univer", "model": draft, "tree": tree, "verifier": verifier}


def engine(target: str, calls: list[dict], spec: dict | None = None, **kwargs) -> dict:
    kw = {"model": target, "max_model_len": 1024, "max_num_seqs": 8, **kwargs}
    if spec is not None:
        kw["speculative_config"] = spec
    return {"kwargs": kw, "calls": calls}


def reference(target: str, calls: list[dict], **kwargs) -> dict:
    """A greedy reference engine (no speculation) that also returns each
    position's top-2 margin, for ``assert_greedy_identical``."""
    return {**engine(target, calls, **kwargs), "margins": True}


def call(prompt_list, **params) -> dict:
    return {"prompts": prompt_list, "params": [params] * len(prompt_list)}


def test_greedy_output_equals_no_speculation_for_every_verifier_and_tree(models):
    """Temperature 0: 8 prompts of different lengths, 200 new tokens each (crossing
    KV blocks of 32): token-for-token what the target alone generates."""
    target, draft = models
    job = call(prompts(8), temperature=0.0, max_tokens=200, ignore_eos=True)
    engines = [reference(target, [job])] + [
        engine(target, [job], univer(draft, tree, method)) for method, tree in GREEDY_CASES
    ]
    results = run_engines(engines)
    ref = results[0]["calls"][0]
    assert all(len(o) == 200 for o in ref["outputs"])
    for (method, tree), result in zip(GREEDY_CASES, results[1:]):
        assert "error" not in result, (method, tree, result.get("error"))
        assert_greedy_identical(result["calls"][0]["outputs"], ref, (method, tree))
        spec = result["spec"]
        assert spec["vllm:spec_decode_num_drafts"] > 0 and spec["vllm:spec_decode_num_accepted_tokens"] > 0


def test_greedy_identity_survives_preemption_and_prefix_caching(models):
    """A KV cache too small for the batch forces preemption (requests restart and
    re-draft from scratch); repeated prompts hit the prefix cache."""
    target, draft = models
    shared = prompts(4, seed=3)
    job = call(shared + shared, temperature=0.0, max_tokens=200, ignore_eos=True)
    kw = {"num_gpu_blocks_override": 40}
    results = run_engines([reference(target, [job], **kw), engine(target, [job], univer(draft, "2x3"), **kw)])
    assert "error" not in results[1], results[1].get("error")
    assert results[1]["spec"]["vllm:num_preemptions"] > 0
    assert_greedy_identical(results[1]["calls"][0]["outputs"], results[0]["calls"][0])


def test_greedy_identity_with_chunked_prefill_and_cut_trees(models):
    """A token budget of 40 per step: long prompts are prefilled in chunks beside
    requests decoding trees, and the scheduler cuts trees short (verified as the
    tree cut to its last full level); the draft catches up on the prompts by
    chunks too, in what the target's tokens leave of the budget (at least 16)."""
    target, draft = models
    rng = random.Random(9)
    long_prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(60, 120))) for _ in range(6)]
    job = call(long_prompts, temperature=0.0, max_tokens=60, ignore_eos=True)
    kw = {"max_num_batched_tokens": 40, "enable_chunked_prefill": True, "max_num_seqs": 6}
    speculating = {**engine(target, [job], univer(draft, "2x3"), **kw), "catch_up_chunks": True}
    results = run_engines([reference(target, [job], **kw), speculating])
    assert "error" not in results[1], results[1].get("error")
    assert_greedy_identical(results[1]["calls"][0]["outputs"], results[0]["calls"][0])
    assert results[1]["catch_up_chunks"] > 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_target_as_its_own_draft_accepts_whole_paths(models, temperature):
    """With q = p every step accepts a full root-to-leaf path: the draft's tree
    attention, positions and KV compaction agree with the target's."""
    target, _ = models
    job = call(prompts(4, seed=1), temperature=temperature, max_tokens=60, ignore_eos=True)
    results = run_engines(
        [engine(target, [job], univer(target, "2x3")), engine(target, [job], univer(target, IRREGULAR, "traversal"))]
    )
    for result, depth in zip(results, (3, 3)):
        assert "error" not in result, result.get("error")
        spec = result["spec"]
        drafts = spec["vllm:spec_decode_num_drafts"]
        per_depth = spec["vllm:spec_decode_num_accepted_tokens_per_pos"][:depth]
        if temperature == 0.0:
            assert per_depth == [drafts] * depth
        else:  # p and q agree to float32 rounding only
            assert min(per_depth) >= 0.97 * drafts


def test_draft_caught_up_by_chunks_accepts_whole_paths(models):
    """The draft's catch-up bounded to 16 tokens a step (``tree_drafter.CATCH_UP_ENV``):
    every prompt (60-120 words) reaches the draft in chunks over several steps, and
    with tree auto's schedule again after plain steps (depth 0), while other requests
    draft trees. With the target as its own draft, greedy, every tree is then accepted
    to its full depth only if each chunk wrote its keys and values where the later
    forwards read them. Greedy output equals no speculation."""
    target, _ = models
    rng = random.Random(4)
    long_prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(60, 120))) for _ in range(5)]
    job = call(long_prompts, temperature=0.0, max_tokens=48, ignore_eos=True)
    engines = [
        reference(target, [job]),
        {**engine(target, [job], auto(target, "2x3")), "catch_up_chunks": True, "sizer": True},
    ]
    env = {"VLLM_UNIVER_CATCH_UP_TOKENS": "16", "VLLM_UNIVER_AUTO_DEPTHS": "3,0,0,3,3"}
    ref, result = run_engines(engines, env=env)
    assert "error" not in result, result.get("error")
    assert_greedy_identical(result["calls"][0]["outputs"], ref["calls"][0])
    assert result["catch_up_chunks"] >= 10, result["catch_up_chunks"]
    spec = result["spec"]
    drafts = spec["vllm:spec_decode_num_drafts"]
    assert drafts > 0
    assert spec["vllm:spec_decode_num_accepted_tokens_per_pos"][:3] == [drafts] * 3, spec
    assert result["sizer"]["requests_at_depth"]["0"] > 0, result["sizer"]


def test_mixed_batch_greedy_requests_equal_no_speculation(models):
    """Greedy and sampled requests (different top-p / top-k, penalties, seeded and
    not) in one batch: each greedy one (with or without presence / frequency /
    repetition penalties, applied per tree path) is its non-speculative output;
    a seeded one repeats."""
    target, draft = models
    texts = prompts(8, seed=2)
    greedy = {"temperature": 0.0, "max_tokens": 120, "ignore_eos": True}
    penalized = {**greedy, "presence_penalty": 0.4, "frequency_penalty": 0.3, "repetition_penalty": 1.2}
    sampled = [
        {"temperature": 1.0, "max_tokens": 120, "ignore_eos": True},
        {"temperature": 0.7, "top_p": 0.9, "max_tokens": 120, "ignore_eos": True, "seed": 7},
        {"temperature": 1.3, "top_k": 20, "max_tokens": 120, "ignore_eos": True},
        {"temperature": 0.5, "top_k": 5, "top_p": 0.8, "max_tokens": 120, "ignore_eos": True, "seed": 11},
    ]
    params = [(greedy if i % 4 == 0 else penalized) if i % 2 == 0 else sampled[i // 2] for i in range(8)]
    mixed = {"prompts": texts, "params": params}
    alone = {"prompts": texts[1::2], "params": params[1::2]}
    results = run_engines(
        [
            reference(target, [{"prompts": texts[::2], "params": params[::2]}]),
            engine(target, [mixed, alone], univer(draft, "2x3")),
        ]
    )
    assert "error" not in results[1], results[1].get("error")
    mixed_out, alone_out = results[1]["calls"][0]["outputs"], results[1]["calls"][1]["outputs"]
    assert_greedy_identical(mixed_out[::2], results[0]["calls"][0])
    assert all(len(o) == 120 for o in mixed_out)
    # Seeded requests (rows 3 and 7 of the mixed batch) do not depend on their batch.
    assert mixed_out[3] == alone_out[1] and mixed_out[7] == alone_out[3]


# tree "dynamic": context-aware trees, each request's own shape per step.
DYNAMIC_CASES = [
    ("univer", {"max_nodes": 8, "max_depth": 4, "expand": 2, "max_children": 2}),
    ("target_only", {"max_nodes": 6, "max_depth": 3, "expand": 1, "max_children": 3}),
    ("greedy", {"max_nodes": 12, "max_depth": 5, "expand": 2, "max_children": 2}),
]


def test_greedy_identity_with_dynamic_trees(models):
    """tree "dynamic" at temperature 0 (each greedy request's tree grown from its own
    draft rows): token for token the target's, for three verifiers and budgets;
    also with prompts prefilled in chunks beside decoding trees that the
    scheduler cuts short, with sampled requests in the batch; and a seeded
    request repeats its text alone."""
    target, draft = models
    job = call(prompts(8, seed=5), temperature=0.0, max_tokens=120, ignore_eos=True)
    engines = [reference(target, [job])]
    engines += [
        engine(target, [job], {**univer(draft, "dynamic", method), **budget}) for method, budget in DYNAMIC_CASES
    ]
    texts = prompts(6, seed=6)
    greedy = {"temperature": 0.0, "max_tokens": 60, "ignore_eos": True}
    sampled = {"temperature": 1.0, "max_tokens": 60, "ignore_eos": True}
    seeded = {"temperature": 0.8, "top_p": 0.9, "max_tokens": 60, "ignore_eos": True, "seed": 5}
    chunked_job = {"prompts": texts, "params": [greedy, sampled, greedy, sampled, greedy, greedy]}
    greedy_texts = [texts[0], texts[2], texts[4], texts[5]]
    # (vLLM 0.32's CPU runner fails seeded requests under chunked prefill by itself: seeds run unchunked.)
    mixed = {"prompts": texts[:4], "params": [greedy, seeded, greedy, sampled]}
    alone = {"prompts": texts[1:2], "params": [seeded]}
    kw = {"max_num_batched_tokens": 40, "enable_chunked_prefill": True, "max_num_seqs": 6}
    dynamic = {**univer(draft, "dynamic"), **DYNAMIC_CASES[0][1]}
    engines += [
        reference(target, [{"prompts": greedy_texts, "params": [greedy] * 4}], **kw),
        engine(target, [chunked_job], dynamic, **kw),
        engine(target, [mixed, alone], dynamic),
    ]
    results = run_engines(engines)
    ref = results[0]["calls"][0]
    for (method, budget), result in zip(DYNAMIC_CASES, results[1:4]):
        assert "error" not in result, (method, budget, result.get("error"))
        assert_greedy_identical(result["calls"][0]["outputs"], ref, (method, budget))
        spec = result["spec"]
        assert spec["vllm:spec_decode_num_drafts"] > 0 and spec["vllm:spec_decode_num_accepted_tokens"] > 0
    chunked_ref, chunked, seeds = results[4:7]
    assert "error" not in chunked and "error" not in seeds, (chunked.get("error"), seeds.get("error"))
    out = chunked["calls"][0]["outputs"]
    assert_greedy_identical([out[0], out[2], out[4], out[5]], chunked_ref["calls"][0], "dynamic, chunked")
    assert all(len(o) == 60 for o in out)
    mixed_out = seeds["calls"][0]["outputs"]
    assert mixed_out[1] == seeds["calls"][1]["outputs"][0]  # a seeded request does not depend on its batch


def test_structured_outputs_with_dynamic_trees(models):
    """tree "dynamic" with structured outputs: vLLM's scheduler builds a request's
    grammar rows from its draft tokens and one shape, so a step with such a request
    drafts the static tree on the dynamic levels (``LevelLayout.static_tree``) and
    the other steps each request's own tree. Greedy requests (regex, JSON schema,
    choice, beside an unconstrained one) equal their non-speculative output, a
    sampled one stays inside its grammar, and a batch without structured outputs
    drafts context-aware trees again."""
    import json

    import regex
    from transformers import AutoTokenizer

    target, _ = models
    texts = prompts(4, seed=12)
    words = "([a-z]+ )*[a-z]+"
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    base = {"temperature": 0.0, "max_tokens": 40}
    params = [
        {**base, "structured_outputs": {"regex": "((tree|draft|token|accept) ){20}"}},
        {**base, "structured_outputs": {"json": json.dumps(schema)}},
        {**base, "structured_outputs": {"choice": ["tree draft", "token accept", "red blue green"]}},
        {**base, "ignore_eos": True},
    ]
    constrained = {"prompts": texts, "params": params}
    sampled = call(texts[:2], temperature=1.0, max_tokens=30, structured_outputs={"regex": words})
    plain = call(texts[:3], temperature=0.0, max_tokens=40, ignore_eos=True)
    # The target drafts for itself: drafts deep in the tree are accepted, so grammar rows
    # built for another shape than the one drafted would show.
    spec = {**univer(target, "dynamic"), **DYNAMIC_CASES[0][1]}
    results = run_engines(
        [
            reference(target, [constrained, plain]),
            {**engine(target, [constrained, sampled, plain], spec), "tree_kinds": True},
        ]
    )
    for result in results:
        assert "error" not in result, result.get("error")
    ref, spec_result = results[0]["calls"], results[1]["calls"]
    assert_greedy_identical(spec_result[0]["outputs"], ref[0], "dynamic, structured")
    assert_greedy_identical(spec_result[2]["outputs"], ref[1], "dynamic, plain")
    tok = AutoTokenizer.from_pretrained(target)
    for out in spec_result[1]["outputs"]:
        assert regex.fullmatch(words, tok.decode(out, skip_special_tokens=True)), tok.decode(out)
    # Steps with a structured request drafted the static tree; the plain batch, per-request trees.
    assert spec_result[0]["tree_kinds"]["static"] > 0 and spec_result[1]["tree_kinds"]["dynamic"] == 0
    assert spec_result[2]["tree_kinds"] == {"static": 0, "dynamic": spec_result[2]["tree_kinds"]["dynamic"]}
    assert spec_result[2]["tree_kinds"]["dynamic"] > 0
    assert results[1]["spec"]["vllm:spec_decode_num_accepted_tokens"] > 0


def test_path_dependent_options_equal_no_speculation(models):
    """allowed_token_ids, bad_words and min_tokens, applied per tree path, and
    logit_bias on every row: greedy requests equal their non-speculative output
    (and differ from the output without the option, so the option bites); a
    sampled request stays inside its allowed tokens."""
    target, draft = models
    texts = prompts(5, seed=6)
    base = {"temperature": 0.0, "max_tokens": 60, "ignore_eos": True}
    allowed = list(range(3, 200))
    bad = ["the", "tree draft", "red", " a"]
    early_stop = {"min_tokens": 25, "stop_token_ids": list(range(3, 120))}
    params = [
        {**base, "allowed_token_ids": allowed},
        {**base, "bad_words": bad},
        {**base, **early_stop},
        {**base, "allowed_token_ids": allowed, "bad_words": bad, **early_stop, "repetition_penalty": 1.2},
        {**base, "logit_bias": {"30": 3.0, "31": 3.0, "40": 2.0, "50": -100.0}, "repetition_penalty": 1.1},
    ]
    options = {"prompts": texts, "params": params}
    sampled = call(texts, temperature=1.0, max_tokens=60, ignore_eos=True, allowed_token_ids=allowed[::3])
    results = run_engines(
        [
            reference(target, [options, call(texts, **base)]),
            engine(target, [options, sampled], univer(draft, "2x3")),
        ]
    )
    assert "error" not in results[1], results[1].get("error")
    ref, plain = results[0]["calls"][0], results[0]["calls"][1]["outputs"]
    assert_greedy_identical(results[1]["calls"][0]["outputs"], ref)
    assert all(r != p for r, p in zip(ref["outputs"], plain))
    assert 25 <= len(ref["outputs"][2]) < 60  # min_tokens held the stop tokens back, then one stopped it
    assert all(set(out) <= set(allowed[::3]) and len(out) == 60 for out in results[1]["calls"][1]["outputs"])


def test_structured_outputs_equal_no_speculation(models):
    """Structured outputs (regexes, a JSON schema, a choice) with one grammar state
    per tree node: greedy requests equal their non-speculative output, beside an
    unconstrained request, with vLLM's default grammar backend (xgrammar) and
    with guidance. The target drafts for itself, so drafts the grammar allows are
    accepted deep into the tree and the others are rejected. A sampled request
    stays inside its grammar."""
    import json

    import regex
    from transformers import AutoTokenizer

    target, _ = models
    texts = prompts(5, seed=9)
    words = "([a-z]+ )*[a-z]+"
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["name", "n"],
    }
    base = {"temperature": 0.0, "max_tokens": 60}
    params = [
        {**base, "structured_outputs": {"regex": words}},
        {**base, "structured_outputs": {"regex": "((tree|draft|token|accept) ){30}"}},
        {**base, "structured_outputs": {"json": json.dumps(schema)}},
        {**base, "structured_outputs": {"choice": ["tree draft", "token accept", "red blue green"]}},
        {**base, "ignore_eos": True},
    ]
    constrained = {"prompts": texts, "params": params}
    sampled = call(texts, temperature=1.0, max_tokens=40, structured_outputs={"regex": words})
    guidance = {"structured_outputs_config": {"backend": "guidance"}}
    results = run_engines(
        [
            reference(target, [constrained]),
            engine(target, [constrained, sampled], univer(target, "2x3")),
            reference(target, [constrained], **guidance),  # backends may differ: each has its own reference
            engine(target, [constrained], univer(target, "2x3"), **guidance),
        ]
    )
    for result in results:
        assert "error" not in result, result.get("error")
        assert all("error" not in c for c in result["calls"]), result["calls"]
    ref = results[0]["calls"][0]["outputs"]
    tok = AutoTokenizer.from_pretrained(target)
    assert regex.fullmatch(words, tok.decode(ref[0], skip_special_tokens=True))
    assert tok.decode(ref[3], skip_special_tokens=True) in ("tree draft", "token accept", "red blue green")
    assert_greedy_identical(results[1]["calls"][0]["outputs"], results[0]["calls"][0], "xgrammar")
    assert_greedy_identical(results[3]["calls"][0]["outputs"], results[2]["calls"][0], "guidance")
    for result in results[1::2]:  # whole paths of depth 3 were accepted
        assert result["spec"]["vllm:spec_decode_num_accepted_tokens_per_pos"][2] > 0, result["spec"]
    for out in results[1]["calls"][1]["outputs"]:
        assert regex.fullmatch(words, tok.decode(out, skip_special_tokens=True), partial=True), out


def test_sampled_request_joining_an_all_greedy_batch(models):
    """All-greedy steps keep no draft q (argmax matching never reads it); when a
    sampled request joins (max_num_seqs=2: it starts when a greedy one finishes),
    the greedy trees drafted without q are verified in a mixed step. Greedy outputs
    stay the non-speculative ones; the sampled request runs to its length."""
    target, draft = models
    texts = prompts(4, seed=8)
    params = [{"temperature": 0.0, "max_tokens": n, "ignore_eos": True} for n in (15, 90)]
    params += [{"temperature": 1.0, "max_tokens": 40, "ignore_eos": True, "seed": s} for s in (1, 2)]
    job = {"prompts": texts, "params": params}
    results = run_engines(
        [
            reference(target, [{"prompts": texts[:2], "params": params[:2]}]),
            engine(target, [job], univer(draft, "2x3"), max_num_seqs=2),
        ]
    )
    assert "error" not in results[1], results[1].get("error")
    out = results[1]["calls"][0]["outputs"]
    assert_greedy_identical(out[:2], results[0]["calls"][0])
    assert [len(o) for o in out[2:]] == [40, 40]


def test_stop_and_max_tokens_cut_an_accepted_path(models):
    """max_tokens and stop tokens in the middle of an accepted path end the request there."""
    target, _ = models
    text = prompts(1, seed=4)
    greedy = {"temperature": 0.0, "ignore_eos": True}
    results = run_engines(
        [
            reference(target, [call(text, max_tokens=40, **greedy)]),
            engine(
                target, [call(text, max_tokens=7, **greedy), call(text, max_tokens=40, **greedy)], univer(target, "1x5")
            ),
        ]
    )
    ref = results[0]["calls"][0]
    full = ref["outputs"][0]
    spec_calls = results[1]["calls"]
    assert len(spec_calls[0]["outputs"][0]) == 7  # 7 = 1 + 5 + 1: cut inside the second path
    assert_greedy_identical(spec_calls[0]["outputs"], truncated(ref, 7), "max_tokens 7")
    assert_greedy_identical(spec_calls[1]["outputs"], ref, "max_tokens 40")
    stop_at = full[10]
    cut = run_engines(
        [engine(target, [call(text, max_tokens=40, stop_token_ids=[stop_at], **greedy)], univer(target, "1x5"))]
    )[0]
    out = cut["calls"][0]["outputs"][0]
    assert out[-1] == stop_at
    assert_greedy_identical([out], truncated(ref, full.index(stop_at) + 1), "stop token")


def test_logprobs_are_the_targets(models):
    """logprobs of generated tokens (and the top alternatives) are the target's
    raw log-probabilities at each output position, as without speculation:
    with a fixed tree, and with tree "auto" cut so that some steps speculate for
    no request of the batch (sampled by vLLM's own sampler), some for a few."""
    target, draft = models
    job = call(prompts(3, seed=5), temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=3)
    # Greedy, no penalties: the reference's processed logprobs are the raw ones.
    # Depth cuts of row i at decision k: cycle[(k + i) % 5]; k = 0, 5, ...: the whole batch at depth 0.
    results = run_engines(
        [
            reference(target, [job]),
            engine(target, [job], univer(draft, "2x3")),
            {**engine(target, [job], auto(draft, "2x3")), "sizer": True},
        ],
        env={"VLLM_UNIVER_AUTO_DEPTHS": "0,0,0,3,2"},
    )
    base = results[0]["calls"][0]
    assert results[2]["sizer"]["requests_at_depth"]["0"] > 0
    worst = 0.0
    for spec in (results[1]["calls"][0], results[2]["calls"][0]):
        assert_greedy_identical(spec["outputs"], base)
        for out_base, out_spec, margins in zip(base["logprobs"], spec["logprobs"], base["margins"]):
            assert len(out_base) == len(out_spec) == 40
            for step_base, step_spec in zip(out_base[: compared_length(margins)], out_spec):
                assert step_base.keys() == step_spec.keys()
                worst = max([worst] + [abs(step_spec[token] - value) for token, value in step_base.items()])
    # The rounding bound the tie-aware greedy comparisons rest on (greedy_identity).
    print(f"\nlargest |tree row - plain row| logprob difference: {worst:.2e} (bound {LOGPROB_ROUNDING:.0e})")
    assert worst <= LOGPROB_ROUNDING


def test_processed_logprob_modes_are_what_each_token_was_sampled_from(models):
    """logprobs_mode processed_logprobs / processed_logits (issue 61: before, tree
    speculation refused them): greedy with a repetition penalty, the same processed
    values as the target alone; sampled at T = 0.7 with top_k = 4 and 4 logprobs, the
    listed values are the law each token was drawn from: its 4 tokens hold all of it
    (logsumexp 0) and the emitted token is one of them; processed_logits are those
    logits (logsumexp of the 4 = that of the row)."""
    target, draft = models
    greedy = call(
        prompts(3, seed=7), temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=3, repetition_penalty=1.3
    )
    sampled = call(prompts(4, seed=8), temperature=0.7, top_k=4, max_tokens=30, ignore_eos=True, logprobs=4, seed=3)
    # The greedy reference (its margins) runs in processed_logprobs mode; the plain
    # engine of processed_logits gives that mode's values.
    results = run_engines(
        [
            reference(target, [greedy]),
            engine(target, [greedy, sampled], univer(draft, "2x3"), logprobs_mode="processed_logprobs"),
            engine(target, [greedy], logprobs_mode="processed_logits"),
            engine(target, [greedy, sampled], univer(draft, "2x3"), logprobs_mode="processed_logits"),
        ]
    )
    margins = results[0]["calls"][0]["margins"]
    for mode, base, spec in [("processed_logprobs", *results[0:2]), ("processed_logits", *results[2:4])]:
        assert "error" not in spec, (mode, spec.get("error"))
        assert spec["spec"]["vllm:spec_decode_num_accepted_tokens"] > 0
        ref, got = base["calls"][0], spec["calls"][0]
        assert_greedy_identical(got["outputs"], results[0]["calls"][0])
        worst = 0.0
        for out_base, out_spec, out_margins in zip(ref["logprobs"], got["logprobs"], margins):
            for step_base, step_spec in zip(out_base[: compared_length(out_margins)], out_spec):
                assert step_base.keys() == step_spec.keys(), mode
                worst = max([worst] + [abs(step_spec[t] - v) for t, v in step_base.items()])
        assert worst <= LOGPROB_ROUNDING, (mode, worst)
        drawn = spec["calls"][1]
        for tokens, steps in zip(drawn["outputs"], drawn["logprobs"]):
            assert len(steps) == len(tokens) == 30
            for token, step in zip(tokens, steps):
                assert str(token) in step, (mode, token, step)
                values = [v for v in step.values() if v != float("-inf")]
                assert len(values) == 4, (mode, step)
                if mode == "processed_logprobs":
                    mass = sum(math.exp(v) for v in values)
                    assert abs(mass - 1.0) <= 1e-4, (mode, step, mass)


# Depth cuts per request and step, and shapes (width cuts of max_tree) per step.
AUTO_SCHEDULE = {"VLLM_UNIVER_AUTO_DEPTHS": "3,0,2,1", "VLLM_UNIVER_AUTO_WIDTHS": "2,1,1"}


def auto(draft: str, max_tree, verifier: str = "univer") -> dict:
    return {"method": "univer", "model": draft, "tree": "auto", "max_tree": max_tree, "verifier": verifier}


def test_greedy_identity_with_tree_auto_cuts(models):
    """tree "auto" with a fixed cycle of depth cuts (``tree_sizer.SCHEDULE_ENV``)
    and of shapes (``WIDTH_SCHEDULE_ENV``: 2x3 and its chain 1x3): cuts change
    between steps and between the requests of one batch, with steps and requests
    that do not speculate (depth 0) and draft caches that then catch up. Greedy
    output equals no speculation for univer, traversal and token, and with
    context-aware trees among the candidates (a budget given)."""
    target, draft = models
    job = call(prompts(6, seed=3), temperature=0.0, max_tokens=120, ignore_eos=True)
    cases = [("univer", "2x3"), ("traversal", "2x3"), ("token", "1x4")]
    engines = [reference(target, [job])] + [
        {**engine(target, [job], auto(draft, tree, method)), "sizer": True} for method, tree in cases
    ]
    # With a budget, context-aware trees are a candidate too (width 0 in the schedule: "dyn").
    with_dynamic = {**auto(draft, "2x3"), "max_nodes": 10, "expand": 2}
    engines.append({**engine(target, [job], with_dynamic), "sizer": True})
    results = run_engines(engines[:-1], env=AUTO_SCHEDULE) + run_engines(
        engines[-1:], env={**AUTO_SCHEDULE, "VLLM_UNIVER_AUTO_WIDTHS": "0,2,1,0"}
    )
    ref = results[0]["calls"][0]
    dynamic = results.pop()
    assert "error" not in dynamic, dynamic.get("error")
    assert_greedy_identical(dynamic["calls"][0]["outputs"], ref, "auto with dynamic trees")
    assert set(dynamic["sizer"]["requests_at_width"]) == {"1", "2", "dyn"}, dynamic["sizer"]
    assert set(dynamic["sizer"]["requests_at_depth"]) == {"0", "1", "2", "3"}, dynamic["sizer"]
    assert dynamic["spec"]["vllm:spec_decode_num_accepted_tokens"] > 0
    for case, result in zip(cases, results[1:]):
        assert "error" not in result, (case, result.get("error"))
        assert_greedy_identical(result["calls"][0]["outputs"], ref, case)
        assert set(result["sizer"]["requests_at_depth"]) == {"0", "1", "2", "3"}, result["sizer"]
        widths = {"1", "2"} if case[1] == "2x3" else {"1"}
        assert set(result["sizer"]["requests_at_width"]) == widths, result["sizer"]
        spec = result["spec"]
        assert spec["vllm:spec_decode_num_accepted_tokens"] > 0
        # /metrics: the histogram of nodes per request per step saw every cut: depth 1, 2
        # and 3 of each shape (2x3: 2, 6, 14 nodes; its chain: 1, 2, 3; 1x4: 1, 2, 3).
        nodes = spec["vllm:univer_tree_nodes_per_request"]
        assert nodes["count"] == spec["vllm:spec_decode_num_drafts"], nodes
        assert nodes["sum"] == spec["vllm:spec_decode_num_draft_tokens"], nodes
        cumulative = list(nodes["buckets"].values())  # le = the cut sizes of every shape, then +Inf
        sizes = [1, 2, 3, 6, 14] if case[1] == "2x3" else [1, 2, 3]
        assert 0 < cumulative[0] and all(a < b for a, b in zip(cumulative, cumulative[1 : len(sizes)])), nodes
        assert set(cumulative[len(sizes) - 1 :]) == {nodes["count"]}, nodes


def test_tree_auto_chooses_for_itself(models, tmp_path):
    """tree "auto" without a schedule, compiled as the main job runs it (no
    enforce_eager: vLLM's profile run then samples through the verifier too):
    calibrated at start-up, a choice every step, each made while the step's target
    forward ran (``choose_ahead``), and the greedy output is the target's. Its
    decision trace (``VLLM_UNIVER_AUTO_TRACE``) has a line per decision that
    ``benchmarks.sizer_trace`` pairs with the tokens the steps yielded."""
    from benchmarks.sizer_trace import steps

    target, draft = models
    job = call(prompts(4, seed=5), temperature=0.0, max_tokens=80, ignore_eos=True)
    auto_engine = {**engine(target, [job], auto(draft, "2x3"), enforce_eager=False), "sizer": True}
    trace = tmp_path / "trace.jsonl"
    results = run_engines([reference(target, [job]), auto_engine], env={"VLLM_UNIVER_AUTO_TRACE": str(trace)})
    assert "error" not in results[1], results[1].get("error")
    assert_greedy_identical(results[1]["calls"][0]["outputs"], results[0]["calls"][0], "auto")
    sizer = results[1]["sizer"]
    print("tree auto on the tiny pair:", sizer)
    assert sum(sizer["requests_at_depth"].values()) >= 80  # a choice per request-step
    assert sizer["decisions_ahead"] == sizer["decisions"] > 20, sizer
    # Two shapes (the chain 1x3 and 2x3), each with a correction per depth 0..3 and hazards per depth 1..3.
    assert [len(c) for c in sizer["cost_correction"]] == [4, 4] and [len(h[0]) for h in sizer["hazards"]] == [3, 3]
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(records) == sizer["decisions"], (len(records), sizer["decisions"])
    assert all(len(r["depths"]) == len(r["req_ids"]) == r["batch"] for r in records)
    periods = steps(records)
    paired = [e for e in periods if e["tokens"] is not None]  # the batch the same over the next two decisions
    # Four requests of 80 tokens: the steps while all four run yield at most their 320 tokens.
    assert len(paired) > 10 and 0 < sum(e["tokens"] for e in paired) <= 320, paired
    assert all(e["seconds"] > 0 for e in periods)


def greedy_and_sampled(seed: int) -> tuple[dict, dict]:
    """Four prompts, greedy and T = 1 in turn, 48 tokens each: (that call, its greedy requests alone)."""
    texts = prompts(4, seed=seed)
    greedy = {"temperature": 0.0, "max_tokens": 48, "ignore_eos": True}
    sampled = {"temperature": 1.0, "max_tokens": 48, "ignore_eos": True}
    return {"prompts": texts, "params": [greedy, sampled] * 2}, call(texts[::2], **greedy)


def test_tree_auto_gives_each_temperature_band_its_own_depth(models):
    """tree "auto" choosing for itself on a batch of greedy and T = 1 requests,
    with acceptance fixed per temperature band (``VLLM_UNIVER_AUTO_HAZARDS``:
    greedy drafts always kept, sampled ones never): the depths the chooser gives
    each request go through the engine, the sampled requests speculate only in
    trials (one depth for all), and the greedy output is the target's. Whether
    the greedy ones speculate depends on the tiny models' timings (a draft
    forward costs about a target forward here); ``test_tree_sizing`` checks the
    choice itself on fixed costs."""
    target, draft = models
    mixed, only_greedy = greedy_and_sampled(seed=9)
    per_band = {str(band): [1.0 if band == 0 else 0.0] * 3 for band in range(4)}
    env = {"VLLM_UNIVER_AUTO_HAZARDS": json.dumps({"1": per_band, "2": per_band})}
    results = run_engines(
        [reference(target, [only_greedy]), {**engine(target, [mixed], auto(draft, "2x3")), "sizer": True}], env=env
    )
    assert "error" not in results[1], results[1].get("error")
    outputs = results[1]["calls"][0]["outputs"]
    assert_greedy_identical(outputs[::2], results[0]["calls"][0], "auto with a depth per temperature band")
    sizer = results[1]["sizer"]
    print("tree auto, greedy and sampled requests:", sizer["requests_at_cut"])
    steps = sum(sizer["requests_at_depth"].values())
    plain = sizer["requests_at_depth"].get("0", 0)
    # The sampled requests' request-steps (half) plain but for trials (2 steps in 16 at most).
    assert plain >= 0.4 * steps, sizer


def test_greedy_trees_deeper_than_a_sampled_tree_left_from_the_step_before(models):
    """Greedy, T = 1 and greedy requests cut by the cycle "1,1,0,2" (row i at
    decision k: depths[(k + i) % 4]): at one step the sampled request drafts to
    depth 1 (its q rows down to depth 1) with the first greedy one, at the next
    only the greedy ones draft, one of them to depth 2, without q (all greedy).
    The sampled request's tree is not verified again, and the step's q has rows
    down to depth 2 (a CI run once failed here, the verifier finding 3 rows of q
    for 7 of p: the chooser's trials made the same sequence by chance). Greedy
    output is the target's."""
    target, draft = models
    texts = prompts(3, seed=11)
    greedy = {"temperature": 0.0, "max_tokens": 48, "ignore_eos": True}
    mixed = {"prompts": texts, "params": [greedy, {**greedy, "temperature": 1.0}, greedy]}
    env = {"VLLM_UNIVER_AUTO_DEPTHS": "1,1,0,2", "VLLM_UNIVER_AUTO_WIDTHS": "2"}
    results = run_engines(
        [
            reference(target, [call(texts[::2], **greedy)]),
            {**engine(target, [mixed], auto(draft, "2x3")), "sizer": True},
        ],
        env=env,
    )
    assert "error" not in results[1], results[1].get("error")
    outputs = results[1]["calls"][0]["outputs"]
    assert_greedy_identical(outputs[::2], results[0]["calls"][0], "greedy trees after a sampled one")
    assert results[1]["sizer"]["requests_at_cut"].keys() >= {"2x1", "2x2"}, results[1]["sizer"]


def test_tree_auto_learns_the_chain_from_the_trees_it_verifies(models):
    """tree "auto" held on the full 2x3 (schedule hooks): the chain 1x3 is never
    drafted, yet its acceptance model learns from every verified tree, greedy and
    sampled rows in one batch (``sizing.chain_estimate``), and the greedy rows'
    output is still the target's."""
    target, draft = models
    mixed, only_greedy = greedy_and_sampled(seed=8)
    env = {"VLLM_UNIVER_AUTO_DEPTHS": "3", "VLLM_UNIVER_AUTO_WIDTHS": "2"}
    results = run_engines(
        [reference(target, [only_greedy]), {**engine(target, [mixed], auto(draft, "2x3")), "sizer": True}], env=env
    )
    assert "error" not in results[1], results[1].get("error")
    outputs = results[1]["calls"][0]["outputs"]
    assert_greedy_identical(outputs[::2], results[0]["calls"][0], "auto 2x3 with the chain learning")
    sizer = results[1]["sizer"]
    assert set(sizer["requests_at_width"]) == {"2"}, sizer  # the chain was never drafted
    chain_evidence, tree_evidence = sizer["evidence"]
    # bands: 0 greedy, 2 for T in (0.5, 1]; the chain saw every tree the tree itself did
    assert chain_evidence == pytest.approx(tree_evidence) and min(chain_evidence[0], chain_evidence[2]) > 5, sizer
    assert all(0 <= h <= 1 for h in sizer["hazards"][0][0] + sizer["hazards"][0][2]), sizer


def test_bfloat16_tree_speculation_runs_on_this_cpu(models):
    """bfloat16, the main job's dtype on CPUs with native bfloat16. On AMX CPUs
    vLLM keeps the KV cache in its amx layout, which tree attention reads in place
    (``kv_cache_views``; the layout itself is checked against vLLM's kernels in
    ``test_kv_cache_views``). (Greedy identity is checked in float32: bfloat16
    rounding of tree rows against plain rows is far above the tie bound.)"""
    target, draft = models
    job = call(prompts(4, seed=6), temperature=0.0, max_tokens=48, ignore_eos=True)
    sampled = call(prompts(4, seed=7), temperature=1.0, max_tokens=48, ignore_eos=True)
    (result,) = run_engines([engine(target, [job, sampled], univer(draft, "2x3"), dtype="bfloat16")])
    assert "error" not in result, result.get("error")
    for c in result["calls"]:
        assert [len(o) for o in c["outputs"]] == [48] * 4
    assert result["spec"]["vllm:spec_decode_num_accepted_tokens"] > 0
