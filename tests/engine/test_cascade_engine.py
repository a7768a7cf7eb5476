"""Cascade (shared-prefix) attention in the engine: steps whose sequences share prefix blocks
attend over each prefix once per group, and the outputs equal the plain path's.

Every case runs the same requests with cascade on (a rule small enough for tiny prompts) and
off, and checks the tokens, the logprobs (fp32) and that the rule did pick cascade (the
counter), so the equality cannot hold vacuously."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.engines import assert_pool_whole, make_engine, step_to_finish
from helpers.tiny_models import random_prompts

from mini_paged_attn.core.cascade import CascadeRule
from mini_paged_attn.engine import SamplingParams
from mini_paged_attn.engine.config import EngineConfig
from mini_paged_attn.models import attention

# Tiny prompts share a few blocks of 4 tokens: the smallest groups and prefixes qualify.
RULE = CascadeRule(min_group_size=2, min_prefix_tokens=4, min_saved_tokens=4)
BASE = dict(block_size=4, num_kv_blocks=160, max_num_seqs=8, max_model_len=96,
            backend="torch")
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2)


def _system_requests(vocab_size: int, *, own_lens=(3, 9, 1, 6, 13, 5), system_len=22,
                     strangers=0, params=GREEDY):
    """A system prompt followed by each request's own tokens, and ``strangers`` requests
    sharing nothing."""
    system = random_prompts(vocab_size, [system_len], seed=1)[0]
    own = random_prompts(vocab_size, own_lens, seed=2)
    others = random_prompts(vocab_size, [7 + 3 * i for i in range(strangers)], seed=3)
    return [(system + o, params) for o in own] + [(p, params) for p in others]


def _run(model_dir, requests, *, cascade: bool, warm: int = 1, **options):
    """Run ``requests`` on a fresh engine: the first ``warm`` alone (its prompt's blocks
    join the prefix cache), then the rest together. Returns (per request and sample: token
    ids and logprobs), the engine."""
    config = {**BASE, **options}
    engine = make_engine(model_dir, cascade_attention=cascade, cascade_rule=RULE, **config)
    ids = [engine.add_request(p, params) for p, params in requests[:warm]]
    final = step_to_finish(engine)
    ids += [engine.add_request(p, params) for p, params in requests[warm:]]
    final.update(step_to_finish(engine))
    results = [[(c.token_ids, c.logprobs) for c in final[i].outputs] for i in ids]
    return results, engine


def _assert_same(on, off):
    assert len(on) == len(off)
    for samples_on, samples_off in zip(on, off):
        assert [t for t, _ in samples_on] == [t for t, _ in samples_off]
        for (_, lp_on), (_, lp_off) in zip(samples_on, samples_off):
            for step_on, step_off in zip(lp_on, lp_off):
                assert step_on.keys() == step_off.keys()
                np.testing.assert_allclose([step_on[k] for k in step_on],
                                           [step_off[k] for k in step_on], atol=1e-5, rtol=0)


def _compare(model_dir, requests, **options):
    """Cascade on and off give the same outputs; the 'on' engine took cascade steps, the
    'off' one none. Returns both engines."""
    on, engine_on = _run(model_dir, requests, cascade=True, **options)
    off, engine_off = _run(model_dir, requests, cascade=False, **options)
    _assert_same(on, off)
    assert engine_on.stats().cascade_steps > 0
    assert engine_off.stats().cascade_steps == 0
    for engine in (engine_on, engine_off):
        assert_pool_whole(engine)
    return engine_on, engine_off


def test_requests_sharing_a_cached_system_prompt(tiny_model_factory):
    model_dir = tiny_model_factory("llama")
    vocab = 256
    engine, _ = _compare(model_dir, _system_requests(vocab))
    assert engine.kv_manager.hit_rate > 0          # the later prompts hit the cached prefix


def test_an_fp8_cache(tiny_model_factory):
    """The op reads an fp8 (e4m3) pool as the plain ops do (scale 1.0)."""
    _compare(tiny_model_factory("llama"), _system_requests(256, own_lens=(3, 9, 5)),
             kv_cache_dtype="fp8")


def test_cascade_on_the_triton_backend(tiny_model_factory):
    """The Triton ops (interpreter on CPU): decode steps with a seq_order by suffix length."""
    model_dir = tiny_model_factory("qwen3")
    _compare(model_dir, _system_requests(256, own_lens=(3, 9, 5), system_len=12),
             backend="triton")


def test_forked_samples_share_their_prompt(tiny_model_factory):
    """n > 1 samples of one request: the forks hold the prompt's blocks."""
    model_dir = tiny_model_factory("llama")
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=6, logprobs=2)
    prompts = random_prompts(256, [21, 10], seed=4)
    _compare(model_dir, [(p, params) for p in prompts], warm=0)


def test_grouped_and_ungrouped_rows_in_one_step(tiny_model_factory):
    """Requests sharing the system prompt and requests sharing nothing, in the same steps."""
    model_dir = tiny_model_factory("qwen2")
    seen = []

    def recording(*args, _real=attention.cascade_attention, **kwargs):
        seen.append((kwargs["suffix_lens"].shape[0], kwargs["group_tokens"].shape[0]))
        return _real(*args, **kwargs)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention, "cascade_attention", recording)
        _compare(model_dir, _system_requests(256, own_lens=(2, 5, 8), strangers=3))
    assert any(grouped < rows for rows, grouped in seen)    # some rows had no prefix part


def test_preemption_with_a_small_pool(tiny_model_factory):
    model_dir = tiny_model_factory("llama")
    engine, _ = _compare(model_dir, _system_requests(256), num_kv_blocks=16)
    assert engine.scheduler.num_preemptions > 0


def test_chunked_prefill_and_mixed_steps(tiny_model_factory):
    """Prompts in chunks of a few tokens ride with the decodes: mixed steps use cascade too."""
    model_dir = tiny_model_factory("llama")
    decode_only = []

    def recording(*args, _real=attention.cascade_attention, **kwargs):
        decode_only.append(kwargs["decode_only"])
        return _real(*args, **kwargs)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention, "cascade_attention", recording)
        _compare(model_dir, _system_requests(256), max_num_batched_tokens=10)
    assert False in decode_only and True in decode_only


@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss"])
def test_windowed_layers_take_the_plain_path(tiny_model_factory, arch):
    """Gemma 2 mixes sliding and full layers (gpt-oss too, with sinks): the full layers
    cascade, the windowed ones attend plainly in the same step."""
    model_dir = tiny_model_factory(arch)
    windows = []

    def recording(*args, _real=attention.cascade_attention, **kwargs):
        windows.append(True)
        return _real(*args, **kwargs)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention, "cascade_attention", recording)
        engine, _ = _compare(model_dir, _system_requests(256, own_lens=(3, 9, 4)))
    layers = [m for m in engine.runner.model.modules() if isinstance(m, attention.Attention)]
    full = sum(m.window_size == (-1, -1) for m in layers)
    assert 0 < full < len(layers)
    assert len(windows) == full * engine.stats().cascade_steps


def test_every_layer_windowed_never_cascades(tiny_model_factory):
    """Mistral's window is on every layer: no layer could use the op, and its tables begin
    with pad entries once blocks leave the window."""
    engine = make_engine(tiny_model_factory("mistral"), cascade_rule=RULE, **BASE)
    assert engine.runner.inputs.cascade_rule is None


def test_nothing_shared_means_no_cascade_step(tiny_model_factory):
    model_dir = tiny_model_factory("llama")
    requests = [(p, GREEDY) for p in random_prompts(256, [5, 9, 14, 3], seed=9)]
    _, engine = _run(model_dir, requests, cascade=True, warm=0)
    assert engine.stats().cascade_steps == 0


def test_the_default_rule_leaves_small_groups_plain(tiny_model_factory):
    """With the default rule, a handful of requests over a short prefix attend plainly."""
    model_dir = tiny_model_factory("llama")
    engine = make_engine(model_dir, **BASE)
    assert engine.runner.inputs.cascade_rule == CascadeRule()
    for prompt, params in _system_requests(256):
        engine.add_request(prompt, params)
    step_to_finish(engine)
    assert engine.stats().cascade_steps == 0


def test_cascade_off_never_calls_the_op(tiny_model_factory, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("cascade_attention called with cascade off")
    monkeypatch.setattr(attention, "cascade_attention", fail)
    _, engine = _run(tiny_model_factory("llama"), _system_requests(256), cascade=False)
    assert engine.runner.inputs.cascade_rule is None
    assert "cascade_suffix_tables" in engine.runner.inputs._i32_regions


def test_tensor_parallel_ranks_rebuild_the_cascade_arrays(tiny_model_factory):
    """``host_arrays`` / ``load`` (what another rank rebuilds a step from) carry the groups."""
    engine = make_engine(tiny_model_factory("llama"), cascade_rule=RULE, **BASE)
    requests = _system_requests(256)
    engine.add_request(*requests[0])
    step_to_finish(engine)
    inputs, built = engine.runner.inputs, []
    build = inputs.build

    def recording(*args, **kwargs):
        step = build(*args, **kwargs)
        if step.cascade is not None:
            built.append((step, inputs.host_arrays(step),
                          {k: v.clone() for k, v in vars(step.cascade).items()}))
        return step
    inputs.build = recording
    for request in requests[1:]:
        engine.add_request(*request)
    step_to_finish(engine)
    assert built
    step, arrays, tensors = built[-1]
    loaded = inputs.load(arrays, table_width=step.block_tables.shape[1],
                         max_seqlen_q=step.max_seqlen_q, num_sample_rows=step.num_sample_rows)
    for name, tensor in tensors.items():
        torch.testing.assert_close(getattr(loaded.cascade, name), tensor, rtol=0, atol=0)


@pytest.mark.parametrize("value", [1, "yes", "auto", None])
def test_config_rejects_a_bad_flag(value):
    with pytest.raises(ValueError, match="cascade_attention"):
        EngineConfig(cascade_attention=value)


def test_config_rejects_a_bad_rule():
    with pytest.raises(ValueError, match="cascade_rule"):
        EngineConfig(cascade_rule={"min_group_size": 2})


def test_the_warm_up_runs_a_cascade_step(tiny_model_factory, monkeypatch):
    """``run_dummy(cascade=True)`` (the CUDA warm-up's cascade steps) goes through the op."""
    engine = make_engine(tiny_model_factory("llama"), cascade_rule=RULE, **BASE)
    engine.cache.pool.zero_()
    calls = []

    def recording(*args, _real=attention.cascade_attention, **kwargs):
        calls.append(kwargs["decode_only"])
        return _real(*args, **kwargs)
    monkeypatch.setattr(attention, "cascade_attention", recording)
    runner = engine.runner
    layers = runner.model_config.num_layers
    hidden = runner.run_dummy([1, 1], runner.kv_caches, decode_only=True, cascade=True)
    assert hidden.shape[0] == 2 and calls == [True] * layers
    hidden = runner.run_dummy([2, 2], runner.kv_caches, decode_only=False, no_prefix=False,
                              cascade=True)
    assert hidden.shape[0] == 4 and calls[layers:] == [False] * layers


@pytest.mark.gpu
def test_cascade_decode_steps_replay_cascade_graphs(tiny_model_factory):
    """On CUDA with decode graphs and asynchronous scheduling: a cascade decode step replays
    its bucket's cascade graph, a prompt step with cascade runs eagerly, plain decode steps
    replay plain graphs, and the outputs equal a cascade-off engine's."""
    model_dir = tiny_model_factory("llama")
    requests = _system_requests(256, own_lens=(3, 9, 1, 6, 13, 5, 2, 7), strangers=2)
    config = dict(BASE, backend="triton", enforce_eager=False)
    prepared = []
    results = {}
    for cascade in (True, False):
        engine = make_engine(model_dir, device="cuda", cascade_attention=cascade,
                             cascade_rule=RULE, **config)
        assert engine.runner.graphs is not None
        assert bool(engine.runner.graphs.cascade_pads) is cascade
        prepare = engine.runner.prepare

        def recording(*args, _prepare=prepare, **kwargs):
            step = _prepare(*args, **kwargs)
            prepared.append(step)
            return step
        engine.runner.prepare = recording
        engine.add_request(*requests[0])
        final = step_to_finish(engine)
        ids = [engine.add_request(*r) for r in requests[1:]]
        final.update(step_to_finish(engine))
        results[cascade] = [(final[i].outputs[0].token_ids, final[i].outputs[0].logprobs)
                            for i in ids]
        if cascade:
            assert engine.stats().cascade_steps > 0
    cascade_steps = [p for p in prepared if p.cascade is not None]
    assert any(p.bucket is not None for p in cascade_steps)
    assert all((p.bucket is not None) == p.out.decode_only for p in cascade_steps)
    assert any(p.bucket is not None and p.cascade is None for p in prepared)
    for (tokens_on, lp_on), (tokens_off, lp_off) in zip(results[True], results[False]):
        assert tokens_on == tokens_off
        for a, b in zip(lp_on, lp_off):
            np.testing.assert_allclose([a[k] for k in a], [b[k] for k in a], atol=1e-3)


def test_tensor_parallel_engine_matches_one_rank(tiny_model_factory):
    """Two ranks (gloo on CPU): rank 1 rebuilds every step, the cascade ones included, from
    rank 0's message (``host_arrays`` / ``load``, checked above), and the outputs equal one
    rank's with cascade off."""
    from mini_paged_attn.engine.llm import LLM
    model_dir = tiny_model_factory("llama")
    requests = _system_requests(256, own_lens=(3, 9, 5))
    off, _ = _run(model_dir, requests, cascade=False)
    llm = LLM(model_dir, dtype="float32", device="cpu", tensor_parallel_size=2,
              cascade_rule=RULE, **BASE)
    try:
        engine = llm.engine
        ids = [engine.add_request(*requests[0])]
        final = step_to_finish(engine)
        ids += [engine.add_request(*r) for r in requests[1:]]
        final.update(step_to_finish(engine))
        on = [[(c.token_ids, c.logprobs) for c in final[i].outputs] for i in ids]
        assert engine.stats().cascade_steps > 0
    finally:
        llm.shutdown()
    _assert_same(on, off)


@pytest.mark.parametrize("device_type, enforce_eager", [
    ("cpu", False), ("cuda", False), ("cuda", True)])
def test_cascade_is_on_by_default_with_graphs_or_without(device_type, enforce_eager):
    """The default rule applies wherever decode steps run: eagerly, or replaying cascade
    graphs; ``cascade_attention=False`` turns it off."""
    from types import SimpleNamespace

    from mini_paged_attn.engine.worker.model_runner import ModelRunner
    from mini_paged_attn.models.attention import Attention

    layer = Attention.__new__(Attention)       # a full-attention layer, nothing else needed
    layer.__dict__["window_size"] = (-1, -1)
    runner = SimpleNamespace(config=EngineConfig(enforce_eager=enforce_eager),
                             device=torch.device(device_type),
                             model=SimpleNamespace(modules=lambda: [layer]))
    assert ModelRunner.cascade_rule(runner) == EngineConfig().cascade_rule
    runner.config = EngineConfig(cascade_attention=False)
    assert ModelRunner.cascade_rule(runner) is None
