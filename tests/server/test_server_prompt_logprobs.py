"""Prompt logprobs over HTTP, through the official openai client: completions with
``echo=true`` and ``logprobs`` (OpenAI's legacy layout: the prompt tokens first, the first one's
logprob null) and vLLM's ``prompt_logprobs`` extra, against the engine's own prompt logprobs
(which tests/engine/test_prompt_logprobs.py checks against a full forward)."""

from __future__ import annotations

import pytest

from server_harness import API_KEY, MODEL_NAME, TIMEOUT_S, served

openai = pytest.importorskip("openai", reason="the openai client (pip install .[test])")

PROMPT = "The quick brown fox"
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def reference(llm):
    """LLM.generate with prompt logprobs, before any server drives the engine."""
    from mini_paged_attn.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2,
                            prompt_logprobs=2)
    return llm.generate([PROMPT], params, use_tqdm=False)[0]


@pytest.fixture(scope="module", params=["thread", "process"])
def client(request, llm, reference, model_dir):
    """A server with the engine in a thread (``llm``'s), or in a child process: its outputs
    cross a pipe as deltas, prompt logprobs included."""
    from mini_paged_attn.engine import MPEngineClient

    core = None
    if request.param == "process":
        core = MPEngineClient(str(model_dir), dict(device="cpu", block_size=16, num_kv_blocks=64,
                                                   max_num_seqs=48, max_model_len=256, seed=0),
                              start_timeout=120)
    try:
        with served(core or llm.engine, api_key=API_KEY) as s:
            yield openai.OpenAI(base_url=f"{s.url}/v1", api_key=API_KEY, max_retries=0,
                                timeout=TIMEOUT_S)
    finally:
        if core is not None:
            core.shutdown()


def _token(llm, tid: int) -> str:
    return llm.tokenizer.decode([tid], skip_special_tokens=False)


def _check_echo(logprobs, ref, llm, text: str):
    prompt_ids = ref.prompt_token_ids
    n = len(prompt_ids)
    assert logprobs.tokens[:n] == [_token(llm, t) for t in prompt_ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for pos in range(1, n):
        entry = ref.prompt_logprobs[pos]
        assert logprobs.token_logprobs[pos] == pytest.approx(entry[prompt_ids[pos]], abs=1e-5)
        best = max(entry, key=entry.get)
        assert logprobs.top_logprobs[pos][_token(llm, best)] == pytest.approx(entry[best],
                                                                              abs=1e-5)
        assert len(logprobs.top_logprobs[pos]) <= 2
    # Then the completion's tokens, as without echo.
    out = ref.outputs[0]
    assert logprobs.tokens[n:] == [_token(llm, t) for t in out.token_ids]
    assert logprobs.token_logprobs[n:] == pytest.approx(
        [lp[t] for t, lp in zip(out.token_ids, out.logprobs)], abs=1e-5)
    # Offsets index the choice's text, echoed prompt included.
    assert logprobs.text_offset[0] == 0
    assert logprobs.text_offset[n] == len(PROMPT)
    assert text == PROMPT + out.text


def test_echo_with_logprobs_gives_the_prompt_tokens_first(client, reference, llm):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                  temperature=0, echo=True, logprobs=2)
    _check_echo(r.choices[0].logprobs, reference, llm, r.choices[0].text)


def test_echo_with_logprobs_streamed(client, reference, llm):
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT,
                                            max_tokens=MAX_TOKENS, temperature=0, echo=True,
                                            logprobs=2, stream=True))
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        lp = chunk.choices[0].logprobs
        for key in merged:
            merged[key] += getattr(lp, key)

    class Merged:
        pass
    m = Merged()
    m.__dict__.update(merged)
    _check_echo(m, reference, llm, "".join(c.choices[0].text for c in chunks))


def test_vllm_prompt_logprobs_extra(client, reference, llm):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                  temperature=0, extra_body={"prompt_logprobs": 1})
    got = r.choices[0].model_extra["prompt_logprobs"]
    ids = reference.prompt_token_ids
    assert len(got) == len(ids) and got[0] is None
    for pos in range(1, len(ids)):
        entry = reference.prompt_logprobs[pos]
        assert got[pos][str(ids[pos])]["logprob"] == pytest.approx(entry[ids[pos]], abs=1e-5)
        assert got[pos][str(ids[pos])]["decoded_token"] == _token(llm, ids[pos])
        assert len(got[pos]) <= 2
    assert r.choices[0].logprobs is None
