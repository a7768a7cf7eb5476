"""The server with its engine in a child process (``MPEngineClient``): same answers as the
in-process engine, blocks freed after cancelled streams, bad input refused before anything is
sent, a dead engine process reported by /health, and the child stopped on shutdown."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from helpers.engine_clients import collect, run_requests, wait_pool_free
from server_harness import API_KEY, GOOD, MODEL_NAME, TIMEOUT_S, assert_error, \
    cancel_mid_stream, served

from mini_paged_attn.engine import MPEngineClient, SamplingParams

PROMPTS = ["The paged cache", "Blocks are shared", "Copy on write", "A tiny random model"]
LLM_KWARGS = dict(device="cpu", block_size=16, num_kv_blocks=64, max_num_seqs=48,
                  max_model_len=256, seed=0)


@pytest.fixture(scope="module")
def core(model_dir):
    events = []
    client = MPEngineClient(str(model_dir), LLM_KWARGS, start_timeout=120,
                            load_progress=events.append)
    client.load_events = events
    yield client
    client.shutdown()
    assert client.process.exitcode is not None  # the child is gone


def test_the_childs_load_progress_reaches_the_client(core):
    finished = [e.phase for e in core.load_events if e.finished]
    assert {"tokenizer", "weights", "kv pool"} <= set(finished)
    weights = [e for e in core.load_events if e.phase == "weights"]
    assert weights[-1].done == weights[-1].total > 0


def test_engine_process_matches_in_process_generate(core, llm):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    with served(core, api_key=API_KEY) as server, server.client() as c:
        got = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPTS,
                                              "max_tokens": 12, "temperature": 0,
                                              "ignore_eos": True}).json()
        assert [ch["text"] for ch in got["choices"]] == [w.text for w in want]
        assert got["usage"]["completion_tokens"] == 12 * len(PROMPTS)

        body = {"model": MODEL_NAME, "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        text = "".join(ch["text"] for e in events[:-1] for ch in json.loads(e)["choices"])
        assert text == want[1].text

        too_long = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": [5] * 250,
                                                   "max_tokens": 10})
        assert too_long.status_code == 400
        assert too_long.json()["error"]["code"] == "context_length_exceeded"
        assert c.get("/health").status_code == 200


def test_engine_process_cancelled_streams_free_every_block(core):
    async def run(url: str) -> None:
        await asyncio.gather(*(cancel_mid_stream(url, f"{PROMPTS[i % 4]} cancel {i}")
                               for i in range(8)))

    with served(core, api_key=API_KEY) as server:
        asyncio.run(run(server.url))
        server.wait_all_free()
    wait_pool_free(core)


def test_engine_process_refuses_bad_requests_before_sending(core):
    with pytest.raises(ValueError, match="max_model_len"):
        core.add_request("too-long", [5] * 250, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="prompt"):
        core.add_request("empty", [], SamplingParams())
    assert not core.abort_request("too-long")    # nothing was sent
    assert core.stats().num_waiting == 0


def test_text_made_in_the_server_process_equals_the_engines(core, llm):
    """Without stop strings the engine process sends token ids only and the client makes the
    text; with them the engine makes it. Either way: what generate gives in one process."""
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    base = llm.generate(PROMPTS[0], greedy, use_tqdm=False)[0].outputs[0]
    stop_token = base.token_ids[5]
    stop_string = base.text[3:5]
    assert stop_string, "the tiny model's greedy text is too short for this test"
    cases = [
        (PROMPTS[0], greedy),
        # A stop token ends the sample: finish reason "stop", and its text is not in the text.
        (PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                    stop_token_ids=[stop_token])),
        # A stop string: the engine finds it in the text, which it then makes and sends.
        (PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                    stop=[stop_string])),
        # Two samples of one request, each with its own text.
        (PROMPTS[2], SamplingParams(temperature=1.0, max_tokens=10, n=2, seed=7,
                                    ignore_eos=True)),
    ]
    want = [llm.generate(p, params, use_tqdm=False)[0] for p, params in cases]
    got = run_requests(core, cases)
    assert want[1].outputs[0].finish_reason == "stop"
    assert stop_string not in want[2].outputs[0].text
    for w, g in zip(want, got):
        assert [(c.text, list(c.token_ids), c.finish_reason) for c in g.outputs] == \
               [(c.text, list(c.token_ids), c.finish_reason) for c in w.outputs]


@pytest.mark.gpu
def test_engine_process_on_the_gpu_matches_generate(model_dir):
    """On CUDA (Triton kernels, CUDA-graph decode, outputs sent in the next step's shadow),
    fp32 so the ids are exact: the engine process gives what generate gives in one process."""
    import torch

    from mini_paged_attn.engine import LLM

    kwargs = dict(device="cuda", dtype="float32", block_size=16, num_kv_blocks=64,
                  max_num_seqs=8, max_model_len=256, seed=0)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    cases = [(p, greedy) for p in PROMPTS] + [
        (PROMPTS[3], SamplingParams(temperature=1.0, max_tokens=16, n=2, seed=5))]
    llm = LLM(str(model_dir), **kwargs)
    want = [llm.generate(p, params, use_tqdm=False)[0] for p, params in cases]
    del llm
    torch.cuda.empty_cache()
    core = MPEngineClient(str(model_dir), kwargs, start_timeout=300)
    try:
        got = run_requests(core, cases)
    finally:
        core.shutdown()
    for w, g in zip(want, got):
        assert [(c.text, list(c.token_ids), c.finish_reason) for c in g.outputs] == \
               [(c.text, list(c.token_ids), c.finish_reason) for c in w.outputs]


def test_streamed_texts_equal_the_in_process_engines_step_by_step(core, model_dir):
    """Every intermediate text the server would stream (made in the server's process from token
    ids) equals what an in-process engine streams for the same requests."""
    from mini_paged_attn.engine import LLM, InprocEngineClient

    cases = [("héllo wörld ✓ 你好", SamplingParams(temperature=1.0, max_tokens=20, seed=3)),
             ([7, 8, 9, 10], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)),
             (PROMPTS[1], SamplingParams(temperature=0.8, max_tokens=14, n=2, seed=11))]
    inproc = InprocEngineClient(LLM(str(model_dir), **LLM_KWARGS).engine)
    try:
        want = _streamed_texts(inproc, cases)
    finally:
        inproc.shutdown()
    assert _streamed_texts(core, cases) == want
    assert any(len(texts) > 5 for texts in want.values())


def _streamed_texts(client, cases) -> dict[str, dict[tuple[int, ...], list[str]]]:
    """Request id -> the completions' texts of each output, by their token counts (the steps
    that add the requests may differ between clients; a text depends on the tokens only)."""
    collector = collect(client, cases, "s")
    return {rid: {tuple(len(c.token_ids) for c in out.outputs): [c.text for c in out.outputs]
                  for out in outs} for rid, outs in collector.outputs.items()}


def test_a_dead_engine_process_fails_requests_and_health(model_dir):
    """The engine's process dies: requests in flight fail with the reason, /health and new
    requests answer 503."""
    client = MPEngineClient(str(model_dir), LLM_KWARGS, start_timeout=120)
    try:
        with served(client, api_key=API_KEY) as s, s.client() as c:
            assert c.get("/health").status_code == 200
            body = {**GOOD, "max_tokens": 200, "ignore_eos": True, "stream": True}
            with c.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
                client.process.kill()
                rest = [line for line in lines if line.startswith("data: ")]
            # The stream ends with OpenAI's error body, then [DONE]; the reason stays in the
            # server's log.
            assert rest[-1] == "data: [DONE]"
            streamed = json.loads(rest[-2][len("data: "):])["error"]
            assert streamed["code"] == "internal_error" and "log" in streamed["message"]
            health = httpx.get(f"{s.url}/health", timeout=TIMEOUT_S)
            err = assert_error(health, 503)
            assert err["code"] == "engine_dead"
            assert assert_error(c.post("/v1/completions", json=GOOD), 503)["code"] == \
                "engine_dead"
            assert s.metrics()["mini_paged_attn_engine_up"] == 0
    finally:
        client.shutdown()
