"""Output deltas (``add_request(deltas=True)``), as the engine process sends them: rebuilt by the
engine-process client after a trip through the pipe's encoding, they equal the cumulative
outputs of an engine stepped in lockstep with the same requests, step by step: n > 1,
logprobs, stop strings and stop tokens, prompt logprobs, special tokens, final-only requests,
structured outputs, samples ending in "error", aborts and a failed step, with asynchronous
scheduling off and on."""

from __future__ import annotations

import pytest

from mini_paged_attn.core.request import FinishReason, Request, SequenceStatus
from mini_paged_attn.core.scheduler import Scheduler, SchedulerConfig
from mini_paged_attn.engine import LLMEngine, SamplingParams
from mini_paged_attn.engine.config import EngineConfig
from mini_paged_attn.engine.deltas import CompletionDelta, OutputDelta, request_of
from mini_paged_attn.engine.output_processor import OutputProcessor, RequestState
from mini_paged_attn.engine.outputs import EngineStats
from mini_paged_attn.engine.process.messages import Outputs, decode, encode
from mini_paged_attn.engine.process.mp_client import _engine_text, _Rebuilt
from mini_paged_attn.models.tiny import byte_level_hf_tokenizer
from mini_paged_attn.models.tokenizer import Tokenizer

PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], [100, 101, 102, 103, 104, 105, 106], [7] * 20]
STATS = EngineStats(kv_blocks_total=64, kv_blocks_free=64)


def _engine(async_scheduling: bool) -> LLMEngine:
    return LLMEngine.from_model("tiny", dtype="float32", device="cpu", config=EngineConfig(
        block_size=4, num_kv_blocks=128, max_num_seqs=16, max_model_len=128,
        async_scheduling=async_scheduling))


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def engines(request):
    """(cumulative, deltas): two engines of the same tiny model and configuration."""
    return _engine(request.param), _engine(request.param)


class _Lockstep:
    """The same requests in both engines, stepped together; each step's deltas go through
    the pipe's encoding and the client's rebuild, and are compared with the cumulative
    outputs."""

    def __init__(self, engines: tuple[LLMEngine, LLMEngine]) -> None:
        self.cumulative, self.deltas = engines
        self.rebuilt: dict[str, _Rebuilt] = {}
        self.steps = 0
        self.finished: dict[str, object] = {}
        self.sent: dict[str, list[OutputDelta]] = {}    # request id -> its deltas

    def add(self, rid: str, prompt: list[int], params: SamplingParams, *,
            final_only: bool = False) -> None:
        self.cumulative.add_request(prompt, params, rid, final_only=final_only)
        self.deltas.add_request(prompt, params, rid, final_only=final_only,
                                detokenize=_engine_text(params), deltas=True)
        self.rebuilt[rid] = _Rebuilt(None, list(prompt),
                                     None if _engine_text(params) else {})

    def abort(self, rid: str) -> None:
        assert self.cumulative.abort_request(rid) and self.deltas.abort_request(rid)

    def step(self) -> None:
        want = self.cumulative.step()
        got = self.deltas.step()
        assert all(type(d) is tuple for d in got)
        for d in got:
            self.sent.setdefault(d[0], []).append(OutputDelta(*d))
        message = decode(encode(Outputs(got, STATS, 0)))
        tokenizer = self.deltas.tokenizer
        rebuilt = [self.rebuilt[d[0]].rebuild(d, tokenizer) for d in message.deltas]
        assert [request_of(o) for o in rebuilt] == [request_of(o) for o in want]
        assert [request_of(d) for d in got] == [request_of(o) for o in want]
        for w, g in zip(want, rebuilt):
            _assert_same(w, g, first=len(self.sent[w.request_id]) == 1)
            if w.finished:
                self.finished[w.request_id] = w
        self.steps += 1

    def run(self, *, abort: dict[int, str] | None = None) -> None:
        abort = abort or {}
        while self.cumulative.has_unfinished_requests():
            if self.steps in abort:
                self.abort(abort[self.steps])
            self.step()
            assert self.steps < 500
        assert not self.deltas.has_unfinished_requests()


def _assert_same(want, got, *, first: bool) -> None:
    assert (got.request_id, got.prompt, got.finished) == \
        (want.request_id, want.prompt, want.finished)
    assert list(got.prompt_token_ids) == list(want.prompt_token_ids)
    assert got.prompt_logprobs == want.prompt_logprobs
    assert len(got.outputs) == len(want.outputs)
    for g, w in zip(got.outputs, want.outputs):
        assert (g.index, g.text, list(g.token_ids), g.finish_reason, g.stop_reason) == \
            (w.index, w.text, list(w.token_ids), w.finish_reason, w.stop_reason)
        assert g.cumulative_logprob == w.cumulative_logprob
        assert (g.logprobs is None) == (w.logprobs is None)
        if w.logprobs is not None:
            assert list(g.logprobs) == list(w.logprobs)
            if want.finished:
                for gl, wl in zip(g.logprobs, w.logprobs):   # Logprob entries: same ranks
                    assert [getattr(v, "rank", None) for v in gl.values()] == \
                        [getattr(v, "rank", None) for v in wl.values()]
    # The metrics are sent in a request's first and finished delta; in between a rebuilt
    # output keeps the first one's.
    gm, wm = got.metrics, want.metrics
    assert gm.num_prompt_tokens == wm.num_prompt_tokens
    assert gm.first_scheduled_time is not None and gm.first_token_time is not None
    if first or want.finished:
        assert (gm.num_cached_tokens, gm.num_generation_tokens) == \
            (wm.num_cached_tokens, wm.num_generation_tokens)
    if want.finished:
        for name in ("first_token_time", "finished_time", "last_token_time"):
            assert (getattr(gm, name) is None) == (getattr(wm, name) is None), name


def test_rebuilt_deltas_equal_the_cumulative_outputs(engines):
    greedy = _Lockstep(engines)     # both engines see the same requests: the same prefix hits
    greedy.add("greedy-text", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12,
                                                         ignore_eos=True))
    greedy.run()
    tokens = list(greedy.finished["greedy-text"].outputs[0].token_ids)
    text = engines[0].tokenizer.decode(tokens)
    stop = text[4:6]                                    # matches in the greedy text
    assert stop and len(stop) == 2
    cases = {
        "greedy": (PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12,
                                              ignore_eos=True)),
        "n2-logprobs": (PROMPTS[1], SamplingParams(temperature=1.0, n=2, seed=3, max_tokens=9,
                                                   ignore_eos=True, logprobs=2)),
        "stop": (PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                            stop=[stop, "\x00never\x00"])),
        "stop-kept": (PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12,
                                                 ignore_eos=True, stop=[stop],
                                                 include_stop_str_in_output=True)),
        "stop-token": (PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12,
                                                  ignore_eos=True, stop_token_ids=[tokens[6]])),
        "prompt-logprobs": (PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=5,
                                                       ignore_eos=True, prompt_logprobs=2,
                                                       logprobs=1)),
        "specials": (PROMPTS[3], SamplingParams(temperature=0.7, seed=1, max_tokens=10,
                                                skip_special_tokens=False)),
    }
    run = _Lockstep(engines)
    for rid, (prompt, params) in cases.items():
        run.add(rid, prompt, params)
    run.add("final-only", PROMPTS[1], SamplingParams(temperature=1.0, n=2, seed=5,
                                                     max_tokens=6, ignore_eos=True,
                                                     logprobs=1, prompt_logprobs=1),
            final_only=True)
    run.run()
    assert set(run.finished) == set(cases) | {"final-only"}
    assert run.finished["stop"].outputs[0].stop_reason == stop
    assert run.finished["stop-token"].outputs[0].stop_reason == tokens[6]
    assert run.finished["prompt-logprobs"].prompt_logprobs is not None


def test_aborted_and_failed_requests_rebuild_as_the_cumulative_ones(engines, monkeypatch):
    run = _Lockstep(engines)
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=1)
    run.add("abort-me", PROMPTS[0], long)
    run.add("stays", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=12,
                                                ignore_eos=True, stop=["\x00never\x00"]))
    for _ in range(3):
        run.step()
    # A step that raises in both engines: what it touched is reported by the next step.
    forwards = [e.runner.forward for e in engines]

    def failing(out, *args):
        raise RuntimeError("a failing forward")
    for engine in engines:
        monkeypatch.setattr(engine.runner, "forward", failing)
    for engine in engines:
        with pytest.raises(RuntimeError, match="failing forward"):
            engine.step()
    for engine, forward in zip(engines, forwards):
        monkeypatch.setattr(engine.runner, "forward", forward)
    run.run(abort={run.steps + 2: "abort-me"})
    assert run.finished["abort-me"].outputs[0].finish_reason == "abort"
    assert run.finished["stays"].outputs[0].finish_reason == "length"


def _processor_state(stop: tuple[str, ...]) -> tuple[OutputProcessor, RequestState, object]:
    tokenizer = Tokenizer(byte_level_hf_tokenizer(), name="bytes")
    params = SamplingParams(max_tokens=20, stop=list(stop), ignore_eos=True)
    request = Request("r", [65, 66, 67], 20, n=1, params=params)
    seq = Scheduler(SchedulerConfig(max_model_len=64), None)._new_sequence(
        request, 0, list(request.prompt_token_ids))
    state = RequestState(request, None, final_only=False, stop=stop, deltas=True)
    return OutputProcessor(tokenizer), state, seq


def test_a_delta_cuts_text_already_sent_when_the_final_text_is_shorter():
    """A text that does not continue what was sent (a stop string cut it) replaces it."""
    processor, state, seq = _processor_state(("zz",))
    rebuilt = _Rebuilt(None, [65, 66, 67], None)
    sent = ""
    for token in b"hello world":
        seq.token_ids.append(token)
        processor.process(state, seq)
        delta = OutputDelta(*processor.make_delta(state))
        (completion,) = [CompletionDelta(*c) for c in delta.completions]
        assert completion.keep == len(sent)
        sent = rebuilt.rebuild(delta, processor.tokenizer).outputs[0].text
    assert sent == "hello worl"                    # one character held back for "zz"
    state.texts[0].final_text = "hello"            # shorter than what was sent
    seq.token_ids.append(ord("!"))
    seq.status, seq.finish_reason = SequenceStatus.FINISHED, FinishReason.STOP
    delta = OutputDelta(*processor.make_delta(state))
    (completion,) = [CompletionDelta(*c) for c in delta.completions]
    # Not a continuation of what was sent: the edit replaces the whole text.
    assert (completion.keep, completion.suffix, completion.finish_reason) == \
        (0, "hello", "stop")
    final = rebuilt.rebuild(delta, processor.tokenizer)
    assert final.outputs[0].text == "hello" and final.finished


def test_deltas_report_metrics_first_and_last_and_prompt_logprobs_once(engines):
    run = _Lockstep(engines)
    run.add("once", PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                               prompt_logprobs=1))
    run.run()
    deltas = run.sent["once"]
    assert len(deltas) == 4 and deltas[-1].finished
    assert [d.metrics is not None for d in deltas] == [True, False, False, True]
    assert deltas[-1].metrics.num_generation_tokens == 4
    assert deltas[0].metrics.first_token_time is not None
    assert [d.prompt_logprobs is not None for d in deltas] == [True, False, False, False]
    assert len(deltas[0].prompt_logprobs) == len(PROMPTS[2])
    assert [len(CompletionDelta(*d.completions[0]).new_token_ids) for d in deltas] == [1] * 4


@pytest.mark.parametrize("bad", [1, None, "yes"])
def test_deltas_must_be_a_bool(engines, bad):
    with pytest.raises(ValueError, match="deltas"):
        engines[1].add_request(PROMPTS[0], SamplingParams(max_tokens=2), deltas=bad)
    assert not engines[1].has_unfinished_requests()


def test_samples_that_end_in_error_and_constrained_ones_rebuild_as_the_cumulative_ones(engines):
    pytest.importorskip("llguidance")
    from mini_paged_attn.engine.structured import StructuredOutputsParams

    run = _Lockstep(engines)
    # The grammar allows only "a" (token 97) and min_tokens bans it as a stop token: nothing
    # can be sampled, the samples end with reason "error".
    run.add("doomed", [120], SamplingParams(
        temperature=1.0, n=2, max_tokens=8, min_tokens=3, stop_token_ids=[97], logprobs=1,
        structured_outputs=StructuredOutputsParams(regex="a")))
    run.add("digits", PROMPTS[1], SamplingParams(
        temperature=1.0, seed=2, max_tokens=8, structured_outputs=StructuredOutputsParams(
            regex="[0-9]{3,6}")))
    run.add("beside", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8,
                                                 ignore_eos=True))
    run.run()
    assert [c.finish_reason for c in run.finished["doomed"].outputs] == ["error", "error"]
    assert run.finished["digits"].outputs[0].text.isdigit()
