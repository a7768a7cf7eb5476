"""The server with its engine in a child process (``EngineCoreClient``): same answers as the
in-process engine, blocks freed after cancelled streams, bad input refused before anything is
sent, and the child stopped on close."""

from __future__ import annotations

import asyncio
import json

import pytest

from server_harness import API_KEY, MODEL_NAME, cancel_mid_stream, served

from mini_paged_attn.engine import SamplingParams

PROMPTS = ["The paged cache", "Blocks are shared", "Copy on write", "A tiny random model"]
LLM_KWARGS = dict(device="cpu", block_size=16, num_kv_blocks=64, max_num_seqs=48,
                  max_model_len=256, seed=0)


def _pool(engine):
    """Runs in the child: the pool's whole state."""
    s = engine.stats()
    return s.kv_blocks_free, s.kv_blocks_total, s.num_running, s.num_waiting


@pytest.fixture(scope="module")
def core(model_dir):
    from mini_paged_attn.server.engine_core_client import EngineCoreClient

    client = EngineCoreClient(str(model_dir), LLM_KWARGS, start_timeout=120)
    yield client
    client.close()
    assert client._proc.exitcode is not None  # the child is gone


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
    free, total, running, waiting = core.call(_pool)
    assert (free, running, waiting) == (total, 0, 0)


def test_engine_process_refuses_bad_requests_before_sending(core):
    with pytest.raises(ValueError, match="max_model_len"):
        core.add_request([5] * 250, SamplingParams(max_tokens=10), request_id="too-long")
    with pytest.raises(ValueError, match="prompt"):
        core.add_request([], SamplingParams(), request_id="empty")
    assert not core.has_unfinished_requests()
    assert core.stats().num_waiting == 0


def _final_outputs(core, requests):
    """Add ``(prompt, params)`` pairs to the engine process, step until all finish; the last
    output of each (what the server streams from)."""
    ids = [core.add_request(p, params, request_id=f"direct-{i}")
           for i, (p, params) in enumerate(requests)]
    final = {}
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finished:
                final[out.request_id] = out
    return [final[i] for i in ids]


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
    got = _final_outputs(core, cases)
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
    from mini_paged_attn.server.engine_core_client import EngineCoreClient

    kwargs = dict(device="cuda", dtype="float32", block_size=16, num_kv_blocks=64,
                  max_num_seqs=8, max_model_len=256, seed=0)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    cases = [(p, greedy) for p in PROMPTS] + [
        (PROMPTS[3], SamplingParams(temperature=1.0, max_tokens=16, n=2, seed=5))]
    llm = LLM(str(model_dir), **kwargs)
    want = [llm.generate(p, params, use_tqdm=False)[0] for p, params in cases]
    del llm
    torch.cuda.empty_cache()
    core = EngineCoreClient(str(model_dir), kwargs, start_timeout=300)
    try:
        got = _final_outputs(core, cases)
    finally:
        core.close()
    for w, g in zip(want, got):
        assert [(c.text, list(c.token_ids), c.finish_reason) for c in g.outputs] == \
               [(c.text, list(c.token_ids), c.finish_reason) for c in w.outputs]


def _poison(engine):
    """Runs in the child: every step holding a request whose id starts with "poison" raises."""
    execute = engine.runner.execute

    def execute_or_fail(out, overlap=None):
        if any(seq.request.request_id.startswith("poison") for seq in out.seqs):
            raise RuntimeError("poison request")
        return execute(out, overlap)
    engine.runner.execute = execute_or_fail


def test_a_failed_step_fails_its_requests_once_and_later_requests_run(model_dir, llm):
    """The child aborts the requests of a failed step itself, so it does not retry the step
    (each retry used to queue one more failure, which then failed later, healthy requests)."""
    from mini_paged_attn.server.engine_core_client import EngineCoreClient

    client = EngineCoreClient(str(model_dir), LLM_KWARGS, start_timeout=120)
    try:
        client.call(_poison)
        client.add_request([5, 6, 7, 8], SamplingParams(max_tokens=4), request_id="poison-1")
        with pytest.raises(RuntimeError, match="poison request"):
            while client.has_unfinished_requests():
                client.step()
        assert not client.has_unfinished_requests()   # aborted there, forgotten here
        greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        want = llm.generate(PROMPTS[:2], greedy, use_tqdm=False)
        got = _final_outputs(client, [(p, greedy) for p in PROMPTS[:2]])
        assert [g.outputs[0].text for g in got] == [w.outputs[0].text for w in want]
        free, total, running, waiting = client.call(_pool)
        assert (free, running, waiting) == (total, 0, 0)
    finally:
        client.close()


def test_streamed_texts_equal_the_in_process_engines_step_by_step(core, model_dir):
    """Every intermediate text the server would stream (made in the server's process from token
    ids) equals what an in-process engine streams for the same requests."""
    from mini_paged_attn.engine import LLM

    cases = [("héllo wörld ✓ 你好", SamplingParams(temperature=1.0, max_tokens=20, seed=3)),
             ([7, 8, 9, 10], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)),
             (PROMPTS[1], SamplingParams(temperature=0.8, max_tokens=14, n=2, seed=11))]
    want = _streamed_texts(LLM(str(model_dir), **LLM_KWARGS).engine, cases)
    assert _streamed_texts(core, cases) == want
    assert any(len(texts) > 5 for texts in want.values())


def _streamed_texts(engine, cases) -> dict[str, list[list[str]]]:
    """Request id -> the completions' texts of each output, in order (an LLMEngine or an
    EngineCoreClient)."""
    texts: dict[str, list[list[str]]] = {}
    for i, (prompt, params) in enumerate(cases):
        engine.add_request(prompt, params, request_id=f"s-{i}")
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts.setdefault(out.request_id, []).append([c.text for c in out.outputs])
    return texts
