"""Streamed outputs are O(1) snapshots (GrowingListView) that never change; finished ones hold lists."""

from __future__ import annotations

import pytest

from mini_paged_attn.engine import LLMEngine, SamplingParams
from mini_paged_attn.engine.config import EngineConfig
from mini_paged_attn.engine.outputs import GrowingListView


def test_growing_list_view_is_a_read_only_snapshot():
    items = [10, 11, 12, 13, 14]
    view = GrowingListView(items, 1, 4)
    items.append(15)                      # appends past the view do not show
    assert len(view) == 3 and view == [11, 12, 13] and [11, 12, 13] == view
    assert view == (11, 12, 13) and view != [11, 12] and view != [11, 12, 14]
    assert view[0] == 11 and view[-1] == 13 and view[1:] == [12, 13] and view[::2] == [11, 13]
    assert view[5:] == [] and view[-2:] == [12, 13] and list(view) == [11, 12, 13]
    assert 12 in view and 14 not in view and view.index(13) == 2 and repr(view) == "[11, 12, 13]"
    for bad in (3, -4):
        with pytest.raises(IndexError):
            view[bad]
    with pytest.raises(TypeError):
        view[0] = 1
    assert GrowingListView(items, 2, 2) == []


def test_streamed_outputs_are_snapshots_and_the_final_one_holds_lists():
    engine = LLMEngine.from_model("tiny", dtype="float32", device="cpu",
                                  config=EngineConfig(block_size=4, num_kv_blocks=32,
                                                      max_num_seqs=4, max_model_len=64))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=2, logprobs=1)
    rid = engine.add_request([5, 6, 7, 8, 9], params)
    seen = []
    while engine.has_unfinished_requests():
        seen += [o for o in engine.step() if o.request_id == rid]
    assert len(seen) == 6 and seen[-1].finished
    final = seen[-1]
    for c in final.outputs:
        assert type(c.token_ids) is list and type(c.logprobs) is list and len(c.token_ids) == 6
    for k, out in enumerate(seen[:-1], start=1):
        for c in out.outputs:
            # Taken at step k, unchanged by the steps after it, a prefix of the final output.
            assert isinstance(c.token_ids, GrowingListView) and len(c.token_ids) == k
            assert c.token_ids == final.outputs[c.index].token_ids[:k]
            assert len(c.logprobs) == k and list(c.logprobs) == final.outputs[c.index].logprobs[:k]
            assert final.outputs[c.index].text.startswith(c.text)
    assert all(o.prompt_token_ids == [5, 6, 7, 8, 9] for o in seen)


def _tiny_engine() -> LLMEngine:
    return LLMEngine.from_model("tiny", dtype="float32", device="cpu",
                                config=EngineConfig(block_size=4, num_kv_blocks=32,
                                                    max_num_seqs=4, max_model_len=64))


def test_detokenize_false_gives_token_ids_only_unless_stop_strings_need_text():
    engine = _tiny_engine()
    greedy = dict(temperature=0.0, max_tokens=8, ignore_eos=True)
    plain = engine.add_request("paged", SamplingParams(**greedy), detokenize=False)
    with_stop = engine.add_request("paged", SamplingParams(**greedy, stop=["\x00never"]),
                                   detokenize=False)
    normal = engine.add_request("paged", SamplingParams(**greedy))
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == plain:
                assert out.outputs[0].text == ""
            if out.finished:
                final[out.request_id] = out.outputs[0]
    assert list(final[plain].token_ids) == list(final[normal].token_ids)
    assert final[plain].text == ""
    assert final[with_stop].text == final[normal].text != ""


def test_detokenize_must_be_a_bool():
    engine = _tiny_engine()
    with pytest.raises(ValueError, match="detokenize"):
        engine.add_request("paged", SamplingParams(max_tokens=2), detokenize="no")
    assert not engine.has_unfinished_requests()


def test_generation_rate_counts_the_steps_of_the_last_window(monkeypatch):
    import time as real_time
    from types import SimpleNamespace

    from mini_paged_attn.engine import step_counters

    engine = _tiny_engine()
    clock = [1000.0]
    monkeypatch.setattr(step_counters, "time", SimpleNamespace(
        perf_counter=lambda: clock[0], monotonic=real_time.monotonic, time=real_time.time))
    step = SimpleNamespace(num_prefill_tokens=0)
    for now, tokens in ((1000.0, 10), (1005.0, 20), (1012.0, 30)):
        clock[0] = now
        engine._count(step, tokens, start=now - 1.0)
    # The first step ended more than RATE_WINDOW_S (10 s) before the last: it is out.
    assert engine.stats().generation_tokens_per_s == pytest.approx((20 + 30) / (1012.0 - 1004.0))
    clock[0] = 1030.0  # nothing in the last window
    assert engine.stats().generation_tokens_per_s == 0.0
