"""The univer server under load, as OpenAI clients use it (tiny models, CPU build).

One server with tree speculation and one without run side by side on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import random
import time
import urllib.request

import numpy as np
import pytest
from transformers import AutoTokenizer

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from greedy_identity import (  # noqa: E402
    LOGPROB_ROUNDING,
    OPENAI_TOP2,
    assert_greedy_text_identical,
    compared_length,
    token_id,
    top2_from_logprobs,
)
from server_utils import vllm_server  # noqa: E402
from tiny_models import WORDS  # noqa: E402


def server_decoder(model: str):
    """Token ids -> text as the server writes it (special tokens skipped)."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def with_top2(params: dict, kind: str) -> dict:
    """Request parameters plus top-2 logprobs with token ids (``greedy_identity``)."""
    extra = OPENAI_TOP2[kind]
    return {**params, **extra, "extra_body": {**params.get("extra_body", {}), **extra["extra_body"]}}


@pytest.fixture(scope="module")
def servers(tiny_pair, tmp_path_factory):
    target, draft = tiny_pair
    root = tmp_path_factory.mktemp("load_logs")
    spec = {"method": "univer", "model": draft, "tree": "2x3"}
    with (
        vllm_server(target, spec, extra_args=("--max-num-seqs", "32"), log_path=root / "spec.log") as spec_url,
        vllm_server(
            target,
            None,
            extra_args=("--max-num-seqs", "32", "--logprobs-mode", "processed_logprobs"),
            log_path=root / "base.log",
        ) as base_url,
    ):
        yield target, spec_url, base_url


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40)))


def _requests(n: int) -> list[dict]:
    rng = random.Random(0)
    out = []
    for i in range(n):
        params = {"max_tokens": rng.choice([16, 40, 80, 120]), "extra_body": {"ignore_eos": True}}
        if i % 2 == 0:
            params["temperature"] = 0.0
        else:
            params.update(temperature=rng.choice([0.7, 1.0, 1.2]), top_p=rng.choice([1.0, 0.9]))
            if i % 4 == 1:
                params["seed"] = i
        out.append({"chat": i % 3 == 0, "prompt": _prompt(rng), "params": params})
    return out


async def _stream(client, model: str, request: dict, top2: bool = False) -> tuple:
    """-> (text, finish_reason, latency seconds, chunks, (token ids, top-2
    logprobs per position) when ``top2``, else None)."""
    start = time.perf_counter()
    pieces, finish, chunks, tokens, tops = [], None, 0, [], []
    if request["chat"]:
        params = with_top2(request["params"], "chat") if top2 else request["params"]
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": request["prompt"]}], stream=True, **params
        )
        async for chunk in stream:
            if chunk.choices:
                choice = chunk.choices[0]
                pieces.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
                chunks += 1
                for item in (choice.logprobs.content or []) if choice.logprobs else []:
                    tokens.append(token_id(item.token))
                    tops.append({alt.token: alt.logprob for alt in item.top_logprobs})
    else:
        params = with_top2(request["params"], "completions") if top2 else request["params"]
        stream = await client.completions.create(model=model, prompt=request["prompt"], stream=True, **params)
        async for chunk in stream:
            if chunk.choices:
                choice = chunk.choices[0]
                pieces.append(choice.text)
                finish = choice.finish_reason or finish
                chunks += 1
                if choice.logprobs:
                    tokens += [token_id(t) for t in choice.logprobs.tokens]
                    tops += choice.logprobs.top_logprobs
    return "".join(pieces), finish, time.perf_counter() - start, chunks, (tokens, tops) if top2 else None


async def _disconnect_early(client, model: str, prompt: str) -> None:
    stream = await client.completions.create(
        model=model, prompt=prompt, stream=True, max_tokens=200, temperature=1.0, extra_body={"ignore_eos": True}
    )
    seen = 0
    async for _ in stream:
        seen += 1
        if seen == 3:
            break
    await stream.close()


def test_64_concurrent_streams_complete_and_greedy_ones_match(servers):
    target, spec_url, base_url = servers
    requests = _requests(64)

    async def run(url: str, with_disconnects: bool):
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600) as client:
            # The reference (no speculation) also returns top-2 logprobs of its greedy streams.
            tasks = [
                _stream(client, target, r, top2=not with_disconnects and r["params"]["temperature"] == 0.0)
                for r in requests
            ]
            if with_disconnects:
                tasks += [_disconnect_early(client, target, f"disconnect {i}") for i in range(8)]
            return await asyncio.gather(*tasks)

    decode = server_decoder(target)
    spec_results = asyncio.run(run(spec_url, True))[:64]
    base_results = asyncio.run(run(base_url, False))
    latencies = np.array([r[2] for r in spec_results])
    print(
        f"\n64 concurrent streams through univer: p50 {np.percentile(latencies, 50):.2f} s, "
        f"p99 {np.percentile(latencies, 99):.2f} s"
    )
    for request, (text, finish, _, chunks, _), base in zip(requests, spec_results, base_results):
        assert finish == "length" and chunks > 0 and text
        if request["params"]["temperature"] == 0.0:
            ref_ids, ref_tops = base[4]
            assert_greedy_text_identical(text, base[0], ref_ids, ref_tops, decode, request)
    with urllib.request.urlopen(spec_url + "/health", timeout=10) as r:
        assert r.status == 200  # the early disconnects left the server healthy


def assert_same_greedy_completion(spec, base, request: dict, decode) -> None:
    """The speculative server's greedy completion is the reference server's (tie-aware)."""
    text = spec.completions.create(**request).choices[0].text
    ref = base.completions.create(**with_top2(request, "completions")).choices[0]
    assert_greedy_text_identical(
        text, ref.text, [token_id(t) for t in ref.logprobs.tokens], ref.logprobs.top_logprobs, decode, request
    )


def test_n_seed_logprobs_and_bad_requests(servers):
    target, spec_url, base_url = servers
    spec = openai.OpenAI(base_url=spec_url + "/v1", api_key="none")
    base = openai.OpenAI(base_url=base_url + "/v1", api_key="none")
    prompt = "the tree draft token verify"
    decode = server_decoder(target)

    many = spec.completions.create(
        model=target, prompt=prompt, n=3, max_tokens=20, temperature=1.0, extra_body={"ignore_eos": True}
    )
    assert len(many.choices) == 3 and all(c.finish_reason == "length" for c in many.choices)

    seeded = [
        spec.completions.create(
            model=target, prompt=prompt, max_tokens=30, temperature=1.0, seed=42, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]

    kw = {
        "model": target,
        "prompt": prompt,
        "max_tokens": 20,
        "temperature": 0.0,
        "logprobs": 2,
        "extra_body": {"ignore_eos": True},
    }
    with_spec = spec.completions.create(**kw).choices[0]
    without = base.completions.create(**with_top2(kw, "completions")).choices[0]
    assert_greedy_text_identical(
        with_spec.text,
        without.text,
        [token_id(t) for t in without.logprobs.tokens],
        without.logprobs.top_logprobs,
        decode,
    )
    same = compared_length(top2_from_logprobs(without.logprobs.top_logprobs)[0])
    np.testing.assert_allclose(
        with_spec.logprobs.token_logprobs[:same], without.logprobs.token_logprobs[:same], atol=LOGPROB_ROUNDING
    )

    # Options applied per tree path: the greedy text is the non-speculative server's.
    options = {
        "model": target,
        "prompt": prompt,
        "max_tokens": 20,
        "temperature": 0.0,
        "extra_body": {
            "ignore_eos": True,
            "min_tokens": 3,
            "allowed_token_ids": list(range(3, 300)),
            "bad_words": ["tree"],
        },
    }
    assert_same_greedy_completion(spec, base, options, decode)

    # Structured outputs, one grammar state per tree node: the greedy text is the non-speculative server's.
    structured = {
        "model": target,
        "prompt": prompt,
        "max_tokens": 30,
        "temperature": 0.0,
        "extra_body": {"structured_outputs": {"regex": "([a-z]+ )*[a-z]+"}},
    }
    assert_same_greedy_completion(spec, base, structured, decode)
    # The OpenAI way to ask for JSON: a chat completion with response_format json_schema.
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["name", "n"],
    }
    chat = {
        "model": target,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 40,
        "temperature": 0.0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "item", "schema": schema}},
    }
    answer = spec.chat.completions.create(**chat).choices[0].message.content
    ref = base.chat.completions.create(**with_top2(chat, "chat")).choices[0]
    assert_greedy_text_identical(
        answer,
        ref.message.content,
        [token_id(t.token) for t in ref.logprobs.content],
        [{alt.token: alt.logprob for alt in t.top_logprobs} for t in ref.logprobs.content],
        decode,
        "json chat",
    )
    assert answer.lstrip().startswith("{")
    with pytest.raises(openai.BadRequestError):
        spec.completions.create(model=target, prompt=prompt, max_tokens=-3)
    assert spec.completions.create(model=target, prompt=prompt, max_tokens=5).choices[0].text is not None
