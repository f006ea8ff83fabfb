"""``vllm serve`` with the plugin on 127.0.0.1, talked to with the ``openai`` client."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from server_utils import get_text, metric_value, streamed_chat, vllm_server  # noqa: E402


@pytest.fixture(scope="module")
def models(tiny_pair):
    return tiny_pair


def test_openai_client_against_univer_server(models, tmp_path):
    target, draft = models
    spec = {"method": "univer", "model": draft, "tree": "2x3", "verifier": "univer"}
    with vllm_server(target, spec, log_path=tmp_path / "server.log") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        completion = client.completions.create(
            model=target, prompt="the tree draft", max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
        )
        assert completion.usage.completion_tokens == 40

        pieces = streamed_chat(client, target)
        assert len(pieces) > 1 and "".join(pieces)

        choices = ["tree draft", "token accept"]
        chosen = client.completions.create(
            model=target, prompt="the", max_tokens=20, extra_body={"structured_outputs": {"choice": choices}}
        )
        assert chosen.choices[0].text in choices
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=target, prompt="the", max_tokens=-1)
        again = client.completions.create(
            model=target, prompt="the tree draft", max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
        )
        assert again.choices[0].text == completion.choices[0].text

        metrics = get_text(url + "/metrics")
        drafts = metric_value(metrics, "vllm:spec_decode_num_drafts_total")
        accepted = metric_value(metrics, "vllm:spec_decode_num_accepted_tokens_total")
        per_pos = metric_value(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos_total")
        assert drafts > 0 and 0 < accepted == per_pos
        # Every draft of the fixed 2x3 tree has its 14 nodes (none cut: the token budget is ample).
        nodes = "vllm:univer_tree_nodes_per_request"
        assert metric_value(metrics, nodes + "_count") == drafts
        assert metric_value(metrics, nodes + "_sum") == 14 * drafts
        assert f'{nodes}_bucket{{engine="0",le="6.0",model_name="{target}"}} 0.0' in metrics
