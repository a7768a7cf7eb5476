"""The engine under adds and aborts that land at any moment (seeded; the tiny Llama on the CPU).

A small pool (preemption), a small token budget (prompt chunks), prefix caching on, prompts that
share a prefix (one of them exactly two full blocks, so it is cached whole), n=1 and n=2, stop
strings. Greedy outputs are checked token for token against the same prompts run alone, so a
sequence that read another's K/V, lost its place or got a token twice would show. Afterwards
every block is free and every reference count is 0.

- ``test_random_adds_and_aborts_from_another_thread``: one thread steps, another adds and aborts
  at random moments (what the server does).
- ``test_abort_at_every_step_of_a_requests_life``: a request aborted between steps at each step
  index of its life (waiting, prompt chunk, just forked, decoding, preempted).
- ``test_two_threads_stepping_is_refused``: a second thread inside step() raises at once
  instead of corrupting the scheduler and the staging buffers.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from mini_paged_attn.core.request import SequenceStatus
from mini_paged_attn.engine import LLMEngine, SamplingParams
from helpers import engines
from helpers.engines import assert_pool_whole

BLOCK_SIZE = 4
MAX_TOKENS = 8


def make_engine(model_dir, **overrides) -> LLMEngine:
    options = dict(block_size=BLOCK_SIZE, num_kv_blocks=12, max_num_seqs=6,
                   max_num_batched_tokens=12, max_model_len=64)
    options.update(overrides)
    return engines.make_engine(model_dir, **options)


def make_prompts(vocab_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    base = torch.randint(3, vocab_size, (2 * BLOCK_SIZE,), generator=gen).tolist()
    tails = [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in (1, 3, 4, 9)]
    other = torch.randint(3, vocab_size, (6,), generator=gen).tolist()
    # base alone: two full blocks, served from the cache once another prompt computed them
    # (all but its last token, which is recomputed for its logits).
    return [base, base + tails[0], base + tails[1], base + tails[2], base + tails[3], other, [7]]


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def case(tiny_model_factory):
    """(model_dir, prompts, {prompt index: (greedy token ids, their text)}) run alone."""
    model_dir = tiny_model_factory("llama")
    engine = make_engine(model_dir, num_kv_blocks=64, max_num_batched_tokens=256,
                         enable_prefix_caching=False)
    prompts = make_prompts(engine.model_config.vocab_size)
    expected = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, GREEDY, request_id=str(i), final_only=True)
        while engine.has_unfinished_requests():
            for out in engine.step():
                expected[i] = (out.outputs[0].token_ids, out.outputs[0].text)
    return model_dir, prompts, expected


def stop_string_for(text: str) -> str | None:
    """Two characters from the middle of ``text`` whose first match is not at its start."""
    for at in range(2, len(text) - 2):
        stop = text[at:at + 2]
        if stop.strip() and text.find(stop) == at:
            return stop
    return None


class Tracker:
    """What each request was asked for, and the outputs it got (checked as they arrive)."""

    def __init__(self, prompts, expected) -> None:
        self.prompts, self.expected = prompts, expected
        self.asked: dict[str, tuple[int, SamplingParams]] = {}
        self.last: dict[str, object] = {}
        self.aborted: set[str] = set()

    def params(self, rng: random.Random, prompt_index: int) -> SamplingParams:
        n = rng.choice((1, 1, 2))
        stop = stop_string_for(self.expected[prompt_index][1]) if rng.random() < 0.3 else None
        return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, n=n,
                              stop=[stop] if stop else None)

    def on_output(self, out) -> None:
        before = self.last.get(out.request_id)
        assert before is None or not before.finished, out
        for c in out.outputs:
            if before is not None and c.index < len(before.outputs):
                prev = before.outputs[c.index]
                assert c.text.startswith(prev.text) and c.token_ids[:len(prev.token_ids)] == prev.token_ids
        self.last[out.request_id] = out

    def check_final(self) -> None:
        for rid, (i, params) in self.asked.items():
            out = self.last[rid]
            assert out.finished, rid
            want_ids, want_text = self.expected[i]
            assert sorted(c.index for c in out.outputs) == list(range(len(out.outputs)))
            for c in out.outputs:
                if c.finish_reason == "abort":
                    assert rid in self.aborted, (rid, out)
                    assert c.token_ids == want_ids[:len(c.token_ids)]
                elif params.stop:
                    assert c.finish_reason == "stop", (rid, c)
                    assert c.text == want_text[:want_text.find(params.stop[0])], (rid, c)
                else:
                    assert c.finish_reason == "length", (rid, c)
                    assert c.token_ids == want_ids, (rid, c)
            if not any(c.finish_reason == "abort" for c in out.outputs):
                assert len(out.outputs) == params.n, (rid, out)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_adds_and_aborts_from_another_thread(case, seed):
    model_dir, prompts, expected = case
    engine = make_engine(model_dir)
    tracker = Tracker(prompts, expected)
    rng = random.Random(seed)
    errors: list[BaseException] = []
    adding = threading.Event()
    adding.set()

    def stepper() -> None:
        try:
            while adding.is_set() or engine.has_unfinished_requests():
                for out in engine.step():
                    tracker.on_output(out)
        except BaseException as exc:   # reported by the main thread
            errors.append(exc)

    thread = threading.Thread(target=stepper)
    thread.start()
    deadline = time.monotonic() + 3.0
    try:
        k = 0
        while time.monotonic() < deadline and not errors:
            if tracker.asked and rng.random() < 0.3:
                rid = rng.choice(sorted(tracker.asked))
                if engine.abort_request(rid):
                    tracker.aborted.add(rid)
            else:
                i = rng.randrange(len(prompts))
                rid = f"s{seed}-{k}"
                k += 1
                params = tracker.params(rng, i)
                tracker.asked[rid] = (i, params)
                engine.add_request(prompts[i], params, request_id=rid)
            time.sleep(rng.choice((0, 0, 0.001, 0.005, 0.02)))
    finally:
        adding.clear()
        thread.join(60)
    assert not thread.is_alive()
    if errors:
        raise errors[0]
    assert len(tracker.asked) > 20 and tracker.aborted
    assert engine.scheduler.num_preemptions > 0          # the pool was tight for real
    assert engine.kv_manager.num_hit_tokens > 0          # and prefixes were shared
    tracker.check_final()
    assert_pool_whole(engine)


def target_state(engine: LLMEngine, rid: str) -> str:
    """Where request ``rid`` is in its life, seen between steps."""
    request = engine.scheduler.requests.get(rid)
    if request is None:
        return "pending" if rid in engine._live else "finished"
    seq = request.sequences[0]
    if seq.status is SequenceStatus.WAITING:
        return "preempted" if request.first_scheduled_time is not None else "waiting"
    if seq.num_computed_tokens < seq.num_tokens - 1:
        return "prompt chunk" if seq.num_output_tokens == 0 else "recompute"
    if len(request.sequences) > 1 and seq.num_output_tokens == 1:
        return "just forked"
    return "decoding"


def test_abort_at_every_step_of_a_requests_life(case):
    """Background requests fill the pool; the target (newest, n=2, a chunked prompt sharing a
    prefix) is aborted after k steps, for every k of its life."""
    model_dir, prompts, expected = case
    engine = make_engine(model_dir, num_kv_blocks=14, max_num_batched_tokens=6)
    seen: set[str] = set()
    background = [(3, 1), (5, 1), (2, 2)]      # (prompt index, n)
    k = 0
    while True:
        tracker = Tracker(prompts, expected)
        for j, (i, n) in enumerate(background):
            rid = f"bg{k}-{j}"
            params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, n=n)
            tracker.asked[rid] = (i, params)
            engine.add_request(prompts[i], params, request_id=rid)
        target = f"t{k}"
        tracker.asked[target] = (4, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                   ignore_eos=True, n=2))
        engine.add_request(prompts[4], tracker.asked[target][1], request_id=target)
        for _ in range(k):
            for out in engine.step():
                tracker.on_output(out)
        state = target_state(engine, target)
        if state == "finished":
            break
        seen.add(state)
        assert engine.abort_request(target)
        tracker.aborted.add(target)
        while engine.has_unfinished_requests():
            for out in engine.step():
                tracker.on_output(out)
        tracker.check_final()
        # (a sample that finished before the abort keeps its own reason)
        assert any(c.finish_reason == "abort" for c in tracker.last[target].outputs), (
            state, tracker.last[target])
        assert_pool_whole(engine)
        k += 1
    assert seen >= {"pending", "waiting", "prompt chunk", "just forked", "decoding",
                    "preempted"}, seen


def test_two_threads_stepping_is_refused(case):
    model_dir, prompts, _ = case
    engine = make_engine(model_dir)
    inside, release = threading.Event(), threading.Event()
    forward = engine.runner.forward

    def slow_forward(out, *args):
        inside.set()
        assert release.wait(30)
        return forward(out, *args)

    engine.runner.forward = slow_forward
    engine.add_request(prompts[1], GREEDY, request_id="a")
    thread = threading.Thread(target=engine.step)
    thread.start()
    try:
        assert inside.wait(30)
        with pytest.raises(RuntimeError, match="another thread is stepping"):
            engine.step()
    finally:
        release.set()
        thread.join(30)
    engine.runner.forward = forward
    while engine.has_unfinished_requests():
        engine.step()
    assert_pool_whole(engine)
