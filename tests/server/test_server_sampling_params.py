"""The sampling parameters clients send, through the official openai client: penalties,
logit_bias, min_tokens, stop_token_ids and echo give what ``LLM.generate`` gives with the same
SamplingParams; out-of-range values are 400s naming the field; /v1/models/{id} and an unknown
model are OpenAI's 404."""

from __future__ import annotations

import httpx
import pytest

from server_harness import API_KEY, GOOD, MODEL_NAME, TIMEOUT_S, assert_error, served

openai = pytest.importorskip("openai", reason="the openai client (pip install .[test])")

PROMPT = "The quick brown fox"
MAX_TOKENS = 10
PROCESSORS = dict(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.3,
                  min_tokens=3, stop_token_ids=[7], logit_bias={7: 2.0, 42: -100.0})


@pytest.fixture(scope="module")
def reference(llm):
    """LLM.generate with the same params, before any server drives the engine."""
    from mini_paged_attn.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, **PROCESSORS)
    forced = SamplingParams(temperature=0.0, max_tokens=5, logit_bias={9: 100.0},
                            stop_token_ids=[9], min_tokens=2)
    return (llm.generate([PROMPT], params, use_tqdm=False)[0],
            llm.generate([PROMPT], forced, use_tqdm=False)[0])


@pytest.fixture(scope="module")
def server(llm, reference):
    with served(llm.engine, api_key=API_KEY) as s:
        yield s


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                         timeout=TIMEOUT_S)


def _extra(**kwargs) -> dict:
    """OpenAI's fields as the client sends them; vLLM's through extra_body."""
    bias = {str(k): v for k, v in PROCESSORS["logit_bias"].items()}
    return dict(presence_penalty=PROCESSORS["presence_penalty"],
                frequency_penalty=PROCESSORS["frequency_penalty"], logit_bias=bias,
                extra_body={k: PROCESSORS[k] for k in ("repetition_penalty", "min_tokens",
                                                       "stop_token_ids")}, **kwargs)


def test_completions_and_chat_apply_every_parameter(server, reference, llm):
    ref, _ = reference
    client = _client(server)
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                  temperature=0, **_extra())
    assert r.choices[0].text == ref.outputs[0].text
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert r.choices[0].finish_reason == ref.outputs[0].finish_reason
    stream = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                       temperature=0, stream=True, **_extra())
    assert "".join(c.choices[0].text for c in stream) == ref.outputs[0].text
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=MAX_TOKENS,
        temperature=0, **_extra())
    assert chat.choices[0].message.content is not None


def test_min_tokens_and_stop_token_ids(server, reference):
    _, forced = reference
    out = forced.outputs[0]
    # The biased stop token is held off for 2 tokens, then ends the completion.
    assert len(out.token_ids) == 3 and out.token_ids[-1] == 9 and out.finish_reason == "stop"
    r = _client(server).completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0, logit_bias={"9": 100},
        extra_body={"stop_token_ids": [9], "min_tokens": 2})
    assert r.choices[0].text == out.text and r.usage.completion_tokens == 3
    assert r.choices[0].finish_reason == "stop"


def test_echo_prepends_the_prompt(server, reference, llm):
    ref, _ = reference
    client = _client(server)
    r = client.completions.create(model=MODEL_NAME, prompt=[PROMPT, "Hello"], n=2,
                                  max_tokens=MAX_TOKENS, temperature=0, echo=True, **_extra())
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == PROMPT + ref.outputs[0].text
    assert r.choices[1].text == PROMPT + ref.outputs[0].text
    assert all(c.text.startswith("Hello") for c in r.choices[2:])
    stream = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                       temperature=0, echo=True, stream=True, **_extra())
    assert "".join(c.choices[0].text for c in stream) == PROMPT + ref.outputs[0].text
    # Token ids echo as their text.
    ids = llm.tokenizer.encode(PROMPT)
    r = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=2, temperature=0,
                                  echo=True)
    assert r.choices[0].text.startswith(PROMPT)


@pytest.mark.parametrize("body,param", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias"),
    ({"logit_bias": {"five": 1}}, "logit_bias"),
    ({"logit_bias": {"-5": 1}}, "logit_bias"),
    ({"logit_bias": {"300": 1}}, "logit_bias"),          # the vocabulary is 300 tokens
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 6, "max_tokens": 5}, "min_tokens"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
    ({"stop_token_ids": "7"}, "stop_token_ids"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
])
def test_out_of_range_is_a_400_naming_the_field(server, body, param):
    with server.client() as c:
        err = assert_error(c.post("/v1/completions", json={**GOOD, **body}), 400, param)
        assert err["type"] == "invalid_request_error"
        chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 5, **body}
        if param not in ("min_tokens",):
            assert_error(c.post("/v1/chat/completions", json=chat), 400, param)


def test_model_by_id_and_unknown_models_are_404(server):
    client = _client(server)
    model = client.models.retrieve(MODEL_NAME)
    assert model.id == MODEL_NAME and model.object == "model"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4")
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="org/other",
                                       messages=[{"role": "user", "content": "hi"}])
    r = httpx.get(f"{server.url}/v1/models/org/other-model",
                  headers={"Authorization": f"Bearer {API_KEY}"}, timeout=TIMEOUT_S)
    assert assert_error(r, 404)["code"] == "model_not_found"
    # Behind the API key like /v1/models.
    assert_error(httpx.get(f"{server.url}/v1/models/{MODEL_NAME}", timeout=TIMEOUT_S), 401)


def test_the_engine_holds_no_token_counts_afterwards(server, llm):
    server.wait_all_free()
    assert len(llm.engine.runner.sampler.history) == 0
