"""vLLM's sampling fields in request bodies: top_k 0, include_stop_str_in_output,
skip_special_tokens; and its stop_reason in every choice."""

from __future__ import annotations

import json

from server_harness import GOOD, assert_error


def test_top_k_zero_is_off(server):
    with server.client() as c:
        assert c.post("/v1/completions", json={**GOOD, "top_k": 0}).status_code == 200
        assert_error(c.post("/v1/completions", json={**GOOD, "top_k": -2}), 400, "top_k")


def test_skip_special_tokens_false_keeps_them(server, llm):
    hf = llm.get_tokenizer()
    special = hf.all_special_ids[0]
    body = {**GOOD, "max_tokens": 2, "ignore_eos": True, "logit_bias": {str(special): 100}}
    with server.client() as c:
        skipped = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
        kept = c.post("/v1/completions", json={**body, "skip_special_tokens": False}).json()
    assert kept["choices"][0]["text"] == hf.convert_ids_to_tokens([special])[0] * 2
    assert skipped == ""
    with server.client() as c:
        assert_error(c.post("/v1/completions", json={**GOOD, "skip_special_tokens": "no"}), 400,
                     "skip_special_tokens")


def test_include_stop_str_in_output(server):
    body = {**GOOD, "max_tokens": 12, "ignore_eos": True}
    with server.client() as c:
        full = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
        stop = full[len(full) // 2:len(full) // 2 + 2]
        cut = c.post("/v1/completions", json={**body, "stop": [stop]}).json()
        kept = c.post("/v1/completions", json={**body, "stop": [stop],
                                               "include_stop_str_in_output": True}).json()
    at = full.find(stop)
    assert cut["choices"][0]["text"] == full[:at]
    assert kept["choices"][0]["text"] == full[:at + len(stop)]


def _stream_choices(c, path: str, body: dict) -> list[dict]:
    with c.stream("POST", path, json={**body, "stream": True}) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
    return [choice for line in lines for choice in json.loads(line)["choices"]]


def test_stop_reason_names_the_stop_string(server):
    # (The stop token id case: tests/engine/test_vllm_sampling_habits.py, through the API.)
    body = {**GOOD, "max_tokens": 12, "ignore_eos": True}
    with server.client() as c:
        full = c.post("/v1/completions", json=body).json()["choices"][0]
        assert full["finish_reason"] == "length" and full["stop_reason"] is None
        stop = full["text"][len(full["text"]) // 2:len(full["text"]) // 2 + 2]
        by_string = c.post("/v1/completions", json={**body, "stop": [stop]}).json()
        assert by_string["choices"][0]["stop_reason"] == stop
        streamed = _stream_choices(c, "/v1/completions", {**body, "stop": [stop]})
        chat = c.post("/v1/chat/completions", json={
            "model": GOOD["model"], "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 12, "ignore_eos": True, "stop": [stop]}).json()
    assert streamed[-1]["finish_reason"] == "stop" and streamed[-1]["stop_reason"] == stop
    assert all(choice["stop_reason"] is None for choice in streamed[:-1])
    assert chat["choices"][0]["stop_reason"] in (stop, None)
    assert (chat["choices"][0]["stop_reason"] == stop) == (chat["choices"][0]["finish_reason"]
                                                           == "stop")
