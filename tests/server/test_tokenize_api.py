"""vLLM's /tokenize, /detokenize and /version, and several served names: shapes, the API key,
the 400s and 404s of the other endpoints."""

from __future__ import annotations

import pytest
from server_harness import API_KEY, MODEL_NAME, assert_error, served

import mini_paged_attn

ALIAS = "org/other-name"


@pytest.fixture(scope="module")
def server(llm):
    with served(llm.engine, api_key=API_KEY, model_name=[MODEL_NAME, ALIAS]) as s:
        yield s


def test_tokenize_a_prompt_as_the_tokenizer_does(server, llm):
    tok = llm.get_tokenizer()
    with server.client() as c:
        r = c.post("/tokenize", json={"model": MODEL_NAME, "prompt": "hello world"})
        plain = c.post("/tokenize", json={"prompt": "hello world", "add_special_tokens": False,
                                          "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode("hello world")
    assert body["count"] == len(body["tokens"])
    assert body["max_model_len"] == llm.engine.max_model_len
    assert body["token_strs"] is None
    ids = tok.encode("hello world", add_special_tokens=False)
    assert plain.json()["tokens"] == ids
    assert plain.json()["token_strs"] == tok.convert_ids_to_tokens(ids)


def test_tokenize_messages_as_the_chat_endpoint_renders_them(server, llm):
    messages = [{"role": "user", "content": "hi there"}]
    expected = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    without = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    with server.client() as c:
        r = c.post("/tokenize", json={"model": MODEL_NAME, "messages": messages})
        bare = c.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})
        both = c.post("/tokenize", json={"messages": messages, "continue_final_message": True})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == list(expected)
    assert bare.json()["tokens"] == list(without)
    assert_error(both, 400)


def test_detokenize_gives_back_the_text(server, llm):
    ids = llm.tokenizer.encode("hello world", add_special_tokens=False)
    with server.client() as c:
        r = c.post("/detokenize", json={"model": ALIAS, "tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": llm.tokenizer.decode(ids)}


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "extra": 1}, 400, "extra"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/detokenize", {"tokens": [10 ** 9]}, 400, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, 400, None),
    ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model"),
])
def test_bad_bodies_are_openai_errors_naming_the_field(server, path, body, status, param):
    with server.client() as c:
        r = c.post(path, json=body)
    err = assert_error(r, status, param)
    if param is None:
        assert err["param"].startswith("tokens")


def test_not_json_is_a_400(server):
    with server.client() as c:
        r = c.post("/tokenize", content=b"{not json", headers={"Content-Type": "application/json"})
    assert_error(r, 400)


def test_tokenizer_endpoints_are_behind_the_key_and_version_is_open(server):
    with server.client(api_key=None) as c:
        assert_error(c.post("/tokenize", json={"prompt": "x"}), 401)
        assert_error(c.post("/detokenize", json={"tokens": [1]}), 401)
        r = c.get("/version")
    assert r.status_code == 200
    assert r.json() == {"version": mini_paged_attn.__version__}


def test_every_served_name_is_listed_and_usable_and_responses_carry_the_first(server):
    with server.client() as c:
        models = c.get("/v1/models").json()["data"]
        one = c.get(f"/v1/models/{ALIAS}")
        r = c.post("/v1/completions", json={"model": ALIAS, "prompt": "hi", "max_tokens": 1})
        missing = c.post("/v1/completions", json={"model": "nope", "prompt": "hi"})
    assert [m["id"] for m in models] == [MODEL_NAME, ALIAS]
    assert one.status_code == 200 and one.json()["id"] == ALIAS
    assert r.status_code == 200, r.text
    assert r.json()["model"] == MODEL_NAME
    err = assert_error(missing, 404, "model")
    assert ALIAS in err["message"]


def test_a_chat_template_of_the_server_is_what_chats_render(llm):
    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    with served(llm.engine, chat_template=template) as s, s.client(api_key=None) as c:
        r = c.post("/tokenize", json={"messages": [{"role": "user", "content": "abc"}]})
    assert r.json()["tokens"] == llm.tokenizer.encode("<<abc>>", add_special_tokens=False)


def test_build_app_refuses_an_empty_name_list(llm):
    from mini_paged_attn.server.app import build_app

    with pytest.raises(ValueError, match="model_name"):
        build_app(llm.engine, model_name=[])
