"""The engine end to end on tiny random Llama / Qwen2 / Qwen3 checkpoints (CPU, fp32).

Greedy outputs must equal transformers' ``generate`` token for token, whatever the engine does
underneath: prefix caching on or off, a pool so small that requests are preempted and
recomputed, a token budget so small that prompts are chunked, n=2 samples sharing their prompt's
blocks. Afterwards every block is free and every reference count is 0. The KV cache starts
NaN-poisoned, so a read of a slot that was never written would show.
"""

from __future__ import annotations

import threading

import pytest
import torch
from helpers.tiny_models import hf_reference_model

from mini_paged_attn.engine import LLM, LLMEngine, SamplingParams
from helpers import engines
from helpers.engines import assert_pool_whole, run_through_failures, step_to_finish

ARCHS = ("llama", "qwen2", "qwen3")
BLOCK_SIZE = 4
MAX_TOKENS = 10
# Lengths around block boundaries; the last two share a 9-token prefix with the third.
PROMPT_LENS = (1, 5, 13, 20, 31)


def make_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    prompts[3][:9] = prompts[2][:9]
    prompts[4][:9] = prompts[2][:9]
    return prompts


def make_engine(model_dir, **overrides) -> LLMEngine:
    options = dict(block_size=BLOCK_SIZE, num_kv_blocks=64, max_num_seqs=8,
                   max_num_batched_tokens=256, max_model_len=128)
    options.update(overrides)
    return engines.make_engine(model_dir, **options)


@pytest.fixture(scope="module", params=ARCHS)
def arch_case(request, tiny_model_factory):
    """(model_dir, prompts, transformers' greedy outputs per prompt)."""
    model_dir = tiny_model_factory(request.param)
    hf = hf_reference_model(model_dir)
    prompts = make_prompts(hf.config.vocab_size)
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
            expected.append(out[0, len(prompt):].tolist())
    return model_dir, prompts, expected


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)

ENGINE_VARIANTS = {
    "prefix-caching": dict(enable_prefix_caching=True),
    "no-prefix-caching": dict(enable_prefix_caching=False),
    # 12 blocks of 4 tokens: the longest request alone needs 10; the others get preempted.
    "preemption": dict(num_kv_blocks=12),
    "chunked-prefill": dict(max_num_batched_tokens=6),
}


@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
def test_greedy_matches_transformers(arch_case, variant):
    model_dir, prompts, expected = arch_case
    engine = make_engine(model_dir, **ENGINE_VARIANTS[variant])
    llm = LLM.from_engine(engine)
    for _ in range(2):   # the second round hits the prefix cache's evictable blocks
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert [o.prompt_token_ids for o in outputs] == prompts
        assert_pool_whole(engine) if variant == "no-prefix-caching" else None
    stats = llm.stats()
    if variant == "preemption":
        assert stats.num_preemptions > 0
    if variant == "prefix-caching":
        assert stats.prefix_cache_hit_rate > 0
        assert outputs[4].metrics.num_cached_tokens > 0
    if variant == "no-prefix-caching":
        assert stats.prefix_cache_hit_rate == 0
    assert_pool_whole(engine)


def test_whole_prompts_attend_over_their_new_kv_and_cached_prefixes_through_the_cache(
        arch_case, monkeypatch):
    """A step of whole prompts attends over the new K/V as they are (varlen, no block table);
    a step with a prefix-cache hit reads the cache. Both give transformers' tokens."""
    from mini_paged_attn.models import attention
    calls = []
    for name in ("flash_attn_varlen_func", "paged_prefill"):
        def counted(*args, _real=getattr(attention, name), _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)
        monkeypatch.setattr(attention, name, counted)
    model_dir, prompts, expected = arch_case
    llm = LLM.from_engine(make_engine(model_dir, enable_prefix_caching=True))
    out = llm.generate(prompts[2:3], GREEDY, use_tqdm=False)
    assert set(calls) == {"flash_attn_varlen_func"}
    assert out[0].outputs[0].token_ids == expected[2]
    calls.clear()
    out = llm.generate(prompts[3:4], GREEDY, use_tqdm=False)    # shares 9 tokens with it
    assert set(calls) == {"paged_prefill"} and out[0].metrics.num_cached_tokens > 0
    assert out[0].outputs[0].token_ids == expected[3]


def test_triton_kernels_with_a_block_size_that_is_no_power_of_two(tiny_model_factory):
    """Block size 24 through the Triton kernels (the interpreter on CPU): prompt tiles straddle
    cache blocks, and the greedy tokens still equal transformers'."""
    model_dir = tiny_model_factory("qwen3")
    hf = hf_reference_model(model_dir)
    gen = torch.Generator().manual_seed(24)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=gen).tolist()
               for n in (1, 23, 25, 49)]
    params = SamplingParams(temperature=0.0, max_tokens=4)
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                max_new_tokens=4, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
                    for p in prompts]
    engine = make_engine(model_dir, block_size=24, num_kv_blocks=16, backend="triton")
    assert engine.runner.backend == "triton"
    outputs = LLM.from_engine(engine).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert_pool_whole(engine)


def test_a_failed_step_leaves_the_engine_usable_and_the_prefix_cache_clean(arch_case):
    """A forward that raises (an error, Ctrl-C in LLM.generate) must not leave blocks that were
    never written in the prefix cache: the same prompts afterwards still match transformers."""
    model_dir, prompts, expected = arch_case
    engine = make_engine(model_dir)
    llm = LLM.from_engine(engine)
    forward = engine.runner.forward
    calls = []

    def fail_on_the_first_step(out, *args):
        calls.append(out)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return forward(out, *args)

    engine.runner.forward = fail_on_the_first_step
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    # Every prompt was in the failed step, the last two hitting blocks the third registered.
    assert calls[0].num_seqs == len(prompts)
    assert calls[0].num_prefill_tokens < sum(map(len, prompts))
    engine.runner.forward = forward
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] \
        == expected
    # The engine also survives a failed step mid-generation (some requests decoding).
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    engine.step()
    engine.runner.forward = fail_on_the_first_step
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    finished = step_to_finish(engine)
    assert [finished[i].outputs[0].token_ids for i in ids] == expected
    assert_pool_whole(engine)


def test_steps_failing_before_the_runner_releases_anything_leak_nothing(tiny_model_factory):
    """Steps that fail at the very start of the runner's work (before it drops the state of
    the sequences that finished since the last step), more often than there are batch rows:
    the engine still serves every request and ends with a whole pool."""
    engine = make_engine(tiny_model_factory("llama"), max_num_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    failures = []

    def when_something_was_released(out) -> bool:
        if out.released_seq_ids and len(failures) < 6:
            failures.append(list(out.released_seq_ids))
            return True
        return False

    finished = run_through_failures(engine, [([5 + i, 6, 7], params) for i in range(8)],
                                    when_something_was_released, max_steps=200,
                                    at="prepare")
    assert len(failures) == 6
    assert all(len(o.outputs[0].token_ids) == 3 for o in finished)
    assert_pool_whole(engine)
    engine.step()   # an idle step hands the runner the last finished ids
    assert engine.cache.tables.num_bound == 0     # every block-table row is free again


@pytest.mark.parametrize("temperature", [1e-40, 5e-324, 1e-6])
def test_a_temperature_too_small_for_float32_is_greedy(tiny_llm, temperature):
    greedy = tiny_llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=6,
                                                         ignore_eos=True), use_tqdm=False)
    tiny = tiny_llm.generate(["hello"], SamplingParams(temperature=temperature, max_tokens=6,
                                                       ignore_eos=True), use_tqdm=False)
    assert SamplingParams(temperature=temperature).greedy
    assert tiny[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids


def test_a_request_aborted_in_a_failed_step_is_retired(tiny_llm):
    engine = tiny_llm.engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    kept = engine.add_request("kept", params)
    aborted = engine.add_request("aborted", params, request_id="aborted")
    engine.step()
    assert engine.abort_request(aborted)
    forward = engine.runner.forward

    def fail(out, *args):
        raise RuntimeError("device lost")

    engine.runner.forward = fail
    try:
        with pytest.raises(RuntimeError, match="device lost"):
            engine.step()
    finally:
        engine.runner.forward = forward
    finished = {}
    for _ in range(20):
        if not engine.has_unfinished_requests():
            break
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert set(finished) == {kept} and len(finished[kept].outputs[0].token_ids) == 4
    assert not engine.has_unfinished_requests()
    engine.add_request("the id is free again", params, request_id="aborted")
    while engine.has_unfinished_requests():
        engine.step()
    assert_pool_whole(engine)


def test_n2_samples_share_the_prompt_blocks(arch_case):
    model_dir, prompts, expected = arch_case
    engine = make_engine(model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, n=2)
    ids = [engine.add_request(p, params) for p in prompts]
    shared = set()
    results = {}
    while engine.has_unfinished_requests():
        for request in list(engine.scheduler.requests.values()):
            seqs = request.sequences
            if len(seqs) == 2 and seqs[0].num_computed_tokens >= BLOCK_SIZE \
                    and seqs[1].num_computed_tokens >= BLOCK_SIZE:
                if seqs[0].block_ids[0] == seqs[1].block_ids[0]:
                    shared.add(request.request_id)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
    for request_id, want in zip(ids, expected):
        got = results[request_id].outputs
        assert [c.index for c in got] == [0, 1]
        assert got[0].token_ids == want and got[1].token_ids == want
    # Every request with a full prompt block shared it between its two samples.
    assert shared == {i for i, p in zip(ids, prompts) if len(p) > BLOCK_SIZE}
    assert_pool_whole(engine)


@pytest.fixture(scope="module")
def tiny_llm():
    llm = LLM("tiny", device="cpu", block_size=BLOCK_SIZE, num_kv_blocks=96, max_model_len=256,
              max_num_seqs=8)
    return llm


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
    ("min_p", 1.5), ("max_tokens", 0), ("n", 0), ("logprobs", 21), ("stop", [""]),
    ("seed", 1.5), ("temperature", float("nan")),
])
def test_sampling_params_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(tiny_llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=12, seed=7)
    alone = tiny_llm.generate("seeded prompt", params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.8, min_p=0.05, max_tokens=12)
    batch = tiny_llm.generate(["another one", "seeded prompt", "and more"], [others, params, others],
                              use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=12, seed=8)
    assert tiny_llm.generate("seeded prompt", other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_top_k_1_is_greedy_and_logprobs_are_returned(tiny_llm):
    greedy = tiny_llm.generate("abc", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    topk1 = tiny_llm.generate("abc", SamplingParams(temperature=1.0, top_k=1, max_tokens=8, logprobs=3),
                              use_tqdm=False)
    out = topk1[0].outputs[0]
    assert out.token_ids == greedy[0].outputs[0].token_ids
    assert len(out.logprobs) == 8 and all(len(lp) == 3 for lp in out.logprobs)   # sampled in top 3
    for token, lp in zip(out.token_ids, out.logprobs):
        assert lp[token] == max(lp.values())
    assert out.cumulative_logprob == pytest.approx(sum(lp[t] for t, lp in zip(out.token_ids, out.logprobs)))


def test_stop_strings_stop_token_ids_and_streaming(tiny_llm):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = tiny_llm.generate("Hello", greedy, use_tqdm=False)[0].outputs[0]
    stop = full.text[8:11]
    assert stop and full.text.find(stop) == 8
    stopped = tiny_llm.generate("Hello", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                        stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.text == full.text[:8]
    streamed = list(tiny_llm.stream("Hello", SamplingParams(temperature=0, max_tokens=24,
                                                            ignore_eos=True, stop=[stop])))
    assert "".join(streamed) == full.text[:8] and len(streamed) > 1
    assert "".join(tiny_llm.stream("Hello", greedy)) == full.text

    token = full.token_ids[5]
    by_token = tiny_llm.generate("Hello", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                         stop_token_ids=[token]), use_tqdm=False)
    out = by_token[0].outputs[0]
    first = full.token_ids.index(token)
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[:first + 1]
    assert_pool_whole(tiny_llm.engine)


def test_chat_uses_the_template(tiny_llm):
    messages = [{"role": "user", "content": "hi"}]
    out = tiny_llm.chat(messages, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert out.prompt_token_ids == tiny_llm.tokenizer.apply_chat_template(messages)
    assert len(out.outputs[0].token_ids) <= 4


def test_abort_frees_blocks_in_any_state(tiny_llm):
    engine = tiny_llm.engine
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    running = engine.add_request("a long enough prompt to hold blocks", params)
    for _ in range(3):
        engine.step()
    waiting = engine.add_request("never scheduled", params)
    assert engine.abort_request(running) and engine.abort_request(waiting)
    assert not engine.abort_request("no such request")
    outputs = {o.request_id: o for o in engine.step()}
    assert outputs[running].finished and outputs[running].outputs[0].finish_reason == "abort"
    assert outputs[waiting].outputs[0].finish_reason == "abort"
    assert len(outputs[running].outputs[0].token_ids) == 3
    assert_pool_whole(engine)


def test_requests_that_can_never_fit_are_rejected(tiny_model_factory):
    engine = make_engine(tiny_model_factory("llama"), num_kv_blocks=8, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(list(range(3, 60)), SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="whole pool"):
        engine.add_request(list(range(3, 30)), SamplingParams(max_tokens=10))   # 36 tokens > 32
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request([10_000], SamplingParams())
    assert not engine.has_unfinished_requests()
    # A request that fits still runs, the rejected ones left no trace.
    engine.add_request(list(range(3, 20)), SamplingParams(max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()
    assert_pool_whole(engine)
    with pytest.raises(ValueError, match="prompts\\[1\\]"):
        LLM.from_engine(engine).generate([[5, 6], list(range(3, 60))], use_tqdm=False)
    assert_pool_whole(engine)


def test_a_stop_string_in_the_last_token_finishes_with_stop(tiny_llm):
    """max_tokens and a stop string both end the sample at its last token: the text stops
    before the stop string, so the reason is "stop" (for each of n samples)."""
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    full = tiny_llm.generate("Hello", greedy, use_tqdm=False)[0].outputs[0]
    assert full.finish_reason == "length"
    # The shortest suffix of the text that occurs nowhere earlier in it.
    stop = next(full.text[-k:] for k in range(1, len(full.text) + 1)
                if full.text.find(full.text[-k:]) == len(full.text) - k)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop=[stop], n=2)
    out = tiny_llm.generate("Hello", params, use_tqdm=False)[0]
    for sample in out.outputs:
        assert sample.token_ids == full.token_ids
        assert sample.text == full.text[:-len(stop)]
        assert sample.finish_reason == "stop"
    assert_pool_whole(tiny_llm.engine)


def test_add_and_abort_from_another_thread(tiny_llm):
    engine = tiny_llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ids: list[str] = []
    done = threading.Event()

    def submitter():
        for i in range(6):
            ids.append(engine.add_request(f"thread prompt {i}", params))
        engine.abort_request(ids[0])
        done.set()

    thread = threading.Thread(target=submitter)
    thread.start()
    finished = {}
    while not done.is_set() or engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    thread.join()
    assert set(finished) == set(ids)
    assert all(len(o.outputs[0].token_ids) == 6 for i, o in finished.items() if i != ids[0])
    assert_pool_whole(engine)


def test_abort_of_a_finishing_request_spares_a_new_one_with_its_id(tiny_llm, monkeypatch):
    """An abort that arrives while its request finishes in the same step must not carry over
    to a new request submitted under the same id afterwards."""
    engine = tiny_llm.engine
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    engine.add_request("finishes in one step", params, request_id="reused")
    update = engine.scheduler.update

    def update_then_abort(*args, **kwargs):
        grew = update(*args, **kwargs)
        assert engine.abort_request("reused")     # still live: the step has not ended yet
        return grew

    monkeypatch.setattr(engine.scheduler, "update", update_then_abort)
    (first,) = engine.step()
    monkeypatch.undo()
    assert first.finished and first.outputs[0].finish_reason == "length"
    engine.add_request("the same id again", SamplingParams(temperature=0, max_tokens=3,
                                                           ignore_eos=True), request_id="reused")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "length"
    assert len(outputs[-1].outputs[0].token_ids) == 3
    assert_pool_whole(engine)


def test_stats_report_the_pool_and_throughput(tiny_llm):
    tiny_llm.generate(["x" * 10, "y" * 10], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    stats = tiny_llm.stats()
    assert stats.kv_blocks_total == 96 and stats.kv_blocks_free == 96
    assert stats.generation_tokens_total >= 10 and stats.generation_tokens_per_s > 0
    assert stats.num_running == 0 and stats.num_waiting == 0


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["graphs", "eager", "preemption", "block-size-80"])
def test_greedy_matches_transformers_on_gpu(arch_case, variant):
    """Triton kernels, CUDA-graph decode (unless eager), fp32 so parity is exact."""
    model_dir, prompts, expected = arch_case
    options = dict(block_size=16, num_kv_blocks=64, max_num_seqs=8, max_model_len=128,
                   enforce_eager=variant == "eager")
    if variant == "preemption":
        options.update(block_size=4, num_kv_blocks=12)
    if variant == "block-size-80":
        options.update(block_size=80, num_kv_blocks=16)
    engine = engines.make_engine(model_dir, device="cuda", **options)
    assert engine.runner.backend == "triton"
    assert (engine.runner.graphs is None) == (variant == "eager")
    outputs = LLM.from_engine(engine).generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    if variant == "preemption":
        assert engine.stats().num_preemptions > 0
    assert_pool_whole(engine)
