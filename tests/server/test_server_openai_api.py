"""The server against LLM.generate: the official openai client and httpx, streamed and not.

Greedy text and token counts through HTTP must equal the engine's own offline output for the
same prompts; many concurrent streams must all finish; cancelled streams must free their blocks.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from server_harness import API_KEY, MODEL_NAME, TIMEOUT_S, cancel_mid_stream, served

# The official client comes with the test extra; the GPU machines run these modules without it.
openai = pytest.importorskip("openai", reason="the openai client (pip install .[test])")

# English, Chinese and emoji: byte-level tokens split characters, so streamed deltas must hold
# incomplete characters back and still add up to the offline text.
PROMPTS = ["The quick brown fox", "你好，世界。分页注意力", "emoji 🙂🚀 and", "Blocks of sixteen tokens live in a pool"]
MAX_TOKENS = 12
CHAT = [[{"role": "system", "content": "You are terse."},
         {"role": "user", "content": "Hello paged attention!"}],
        [{"role": "user", "content": "你好 🙂"}]]


@pytest.fixture(scope="module")
def reference(llm):
    """LLM.generate / LLM.chat outputs, computed before any server drives the engine."""
    from mini_paged_attn.engine import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    completions = llm.generate(PROMPTS, greedy, use_tqdm=False)
    chats = [llm.chat(messages, greedy)[0] for messages in CHAT]
    return completions, chats


@pytest.fixture(scope="module")
def server(llm, reference):
    with served(llm.engine, api_key=API_KEY) as s:
        yield s


def _client(server, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                         timeout=TIMEOUT_S, **kwargs)


def test_models_health_metrics(server):
    with server.client() as c:
        models = c.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == [MODEL_NAME]
        assert c.get("/health").status_code == 200
    m = server.metrics()
    for name in ("requests_running", "requests_waiting", "kv_blocks_total", "kv_blocks_free",
                 "prefix_cache_hit_rate", "preemptions_total", "generation_tokens_total"):
        assert f"mini_paged_attn_{name}" in m, name
    assert m["mini_paged_attn_kv_blocks_total"] == 64


def test_completions_match_generate(server, reference):
    completions, _ = reference
    client = _client(server)
    # One prompt per request, then all of them in one request (choices in prompt order).
    for prompt, ref in zip(PROMPTS, completions):
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS,
                                      temperature=0)
        assert r.choices[0].text == ref.outputs[0].text
        assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert r.choices[0].finish_reason == ref.outputs[0].finish_reason
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=MAX_TOKENS,
                                  temperature=0)
    assert [c.text for c in r.choices] == [ref.outputs[0].text for ref in completions]
    assert [c.index for c in r.choices] == list(range(len(PROMPTS)))
    assert r.usage.completion_tokens == sum(len(ref.outputs[0].token_ids) for ref in completions)
    # Token ids as the prompt.
    ref = completions[1]
    r = client.completions.create(model=MODEL_NAME, prompt=ref.prompt_token_ids,
                                  max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == ref.outputs[0].text


def test_completions_streamed_match_generate(server, reference):
    completions, _ = reference
    client = _client(server)
    for prompt, ref in zip(PROMPTS, completions):
        stream = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == ref.outputs[0].text
        assert len([c for c in chunks if c.choices]) > 1, "not streamed"
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == \
            ref.outputs[0].finish_reason
        assert chunks[-1].choices == []  # the usage chunk comes last, with no choices
        assert chunks[-1].usage.completion_tokens == len(ref.outputs[0].token_ids)
        assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)


def test_chat_match_llm_chat(server, reference):
    _, chats = reference
    client = _client(server)
    for messages, ref in zip(CHAT, chats):
        r = client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                           max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].message.content == ref.outputs[0].text
        assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)

        stream = client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                                max_tokens=MAX_TOKENS, temperature=0,
                                                stream=True,
                                                stream_options={"include_usage": True})
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == ref.outputs[0].text
        assert chunks[-1].usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_raw_sse_wire_format(server, reference):
    """Plain httpx: `data: {json}` events, then `data: [DONE]`; no usage chunk unless asked."""
    completions, _ = reference
    body = {"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": True}
    with server.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert all(ch["object"] == "text_completion" and "usage" not in ch for ch in chunks)
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == completions[0].outputs[0].text


def test_logprobs_and_n(server):
    client = _client(server)
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=4,
                                  temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 2 and chosen <= 0
        assert chosen == pytest.approx(max(top.values()))  # greedy picks the most likely
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT[0], max_tokens=3,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)
    # n samples of one prompt, seeded: reproducible, each with its own index.
    kwargs = dict(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=6, temperature=1.0, n=2,
                  seed=7, extra_body={"ignore_eos": True})
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == 12


def test_concurrent_streams_then_cancelled_ones_free_every_block(server, llm):
    """32 concurrent streams all finish with the right token counts; 8 more, cancelled
    mid-stream, leave no block held (/metrics and LLM.stats())."""

    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY,
                                    max_retries=0, timeout=TIMEOUT_S)

        async def one(i: int) -> tuple[int, int, str]:
            want = 4 + i % 9
            stream = await client.completions.create(
                model=MODEL_NAME, prompt=f"{PROMPTS[i % 4]} #{i}", max_tokens=want,
                temperature=0, stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True})
            usage, reasons = None, []
            async for chunk in stream:
                usage = chunk.usage or usage
                reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
            return want, usage.completion_tokens, reasons

        results = await asyncio.gather(*(one(i) for i in range(32)))
        assert [(want, got) for want, got, _ in results] == [(want, want) for want, _, _ in results]
        assert all(reasons == ["length"] for _, _, reasons in results)

        await asyncio.gather(*(cancel_mid_stream(server.url, f"{PROMPTS[i % 4]} cancel {i}")
                               for i in range(8)))

    before = server.metrics()['mini_paged_attn_server_requests_total{outcome="aborted"}']
    asyncio.run(run())
    m = server.wait_all_free()
    assert m['mini_paged_attn_server_requests_total{outcome="aborted"}'] - before == 8
    stats = llm.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert stats.num_running == stats.num_waiting == 0
    assert m["mini_paged_attn_generation_tokens_total"] == stats.generation_tokens_total
