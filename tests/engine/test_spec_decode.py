"""Speculative decoding (prompt lookup) through the engine: greedy outputs token for token those
of the same engine without it, for every family the engine serves, with prefix caching, chunked
prefill, preemption (a pool of a few blocks), n > 1, stop strings and stop tokens inside
accepted runs, max_tokens at every length, and prompts that repeat themselves so that proposals
are accepted; then the statistics, the requests that do not speculate, the batch size past which
no step does, and the configuration's checks.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.engines import ENGINE, assert_pool_whole, make_prompts
from helpers.tiny_models import ARCHS, TINY_WINDOW

from mini_paged_attn.engine import LLM, SamplingParams
from mini_paged_attn.engine.config import EngineConfig
from mini_paged_attn.engine.spec.config import SpeculativeConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
MAX_TOKENS = 16
# Families whose every layer is windowed give blocks back: a smaller pool still preempts.
OVERRIDES = {"mixtral": {"sliding_window": TINY_WINDOW}}
SMALL_POOL = {"mistral": 6, "mixtral": 6}


def _llm(model_dir, arch, **options):
    settings = dict(ENGINE, num_kv_blocks=SMALL_POOL.get(arch, ENGINE["num_kv_blocks"]))
    settings.update(options)
    llm = LLM(model_dir, dtype="float32", device="cpu", **settings)
    llm.engine.cache.pool.fill_(float("nan"))
    return llm


def _repeating_prompts(vocab_size: int) -> list[list[int]]:
    """Prompts that say one passage three times, so their continuations are often found in
    them (and the tiny models' outputs fall into loops that the lookup then proposes)."""
    gen = torch.Generator().manual_seed(7)
    passages = [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in (5, 7)]
    return [p * 3 for p in passages]


def _requests(llm_base, vocab_size):
    """The workload: plain prompts with a shared prefix, repeating prompts (at several
    max_tokens, n = 2, a stop string taken from the output, a stop token from it)."""
    plain = make_prompts(vocab_size)
    repeating = _repeating_prompts(vocab_size)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    full = llm_base.generate(repeating[0], greedy, use_tqdm=False)[0].outputs[0]
    stop_text = full.text[len(full.text) // 2:len(full.text) // 2 + 2]
    stop_token = full.token_ids[MAX_TOKENS // 2]
    requests = [(p, greedy) for p in plain + repeating]
    requests += [(repeating[1], SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True))
                 for m in (1, 2, 3, 5)]
    requests.append((repeating[0], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, n=2,
                                                  ignore_eos=True)))
    if stop_text.strip():
        requests.append((repeating[0], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                      ignore_eos=True, stop=[stop_text])))
    requests.append((repeating[0], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                  stop_token_ids=[stop_token])))
    # A bias on two or three of the prompt's tokens: the output is made of them, so the lookup
    # finds it (the model's logits still pick among them); stop strings from such an output
    # land inside accepted runs.
    for favoured in (repeating[0][:2], repeating[1][:3]):
        biased = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                logit_bias={t: 10.0 for t in favoured})
        requests.append((repeating[1], biased))
        text = llm_base.generate(repeating[1], biased, use_tqdm=False)[0].outputs[0].text
        for at in (len(text) // 3, len(text) // 2, 2 * len(text) // 3):
            if text[at:at + 3].strip():
                requests.append((repeating[1], dataclasses.replace(biased,
                                                                   stop=[text[at:at + 3]])))
    return requests


def _outputs(llm, requests):
    prompts = [p for p, _ in requests]
    params = [s for _, s in requests]
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
            for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_outputs_equal_the_engine_without_speculation(tiny_model_factory, arch):
    model_dir = tiny_model_factory(arch, **OVERRIDES.get(arch, {}))
    base = _llm(model_dir, arch)
    spec = _llm(model_dir, arch, speculative_config=NGRAM)
    requests = _requests(base, base.engine.model_config.vocab_size)
    expected = _outputs(base, requests)
    for _ in range(2):          # the second round hits the prefix cache
        assert _outputs(spec, requests) == expected
    stats = spec.stats()
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens > 0, stats
    assert stats.num_preemptions > 0
    windowed = spec.engine.model_config.uniform_sliding_window is not None
    assert stats.prefix_cache_hit_rate > 0 or windowed
    # A verified run counts each token it added, as steps of one token would.
    assert stats.generation_tokens_total == 2 * sum(len(c[0]) for o in expected for c in o)
    assert_pool_whole(spec.engine)


def _draft(model_dir, k=4):
    return {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": k}


def _assert_draft_pool_whole(llm):
    draft = llm.engine.speculator.draft
    assert not draft._shadows
    assert draft.kv.num_free_blocks() == draft.kv.num_blocks


@pytest.mark.parametrize("arch", ARCHS)
def test_draft_model_greedy_outputs_equal_the_engine_without_speculation(
        tiny_model_factory, arch):
    """The target as its own draft: every proposal is kept, so stop strings, stop tokens and
    max_tokens land inside accepted runs; prompts longer than a step's tokens catch up in
    chunks; a windowed draft keeps its blocks (the window is the kernels' mask)."""
    model_dir = tiny_model_factory(arch, **OVERRIDES.get(arch, {}))
    base = _llm(model_dir, arch)
    spec = _llm(model_dir, arch, speculative_config=_draft(model_dir))
    requests = _requests(base, base.engine.model_config.vocab_size)
    expected = _outputs(base, requests)
    for _ in range(2):          # the second round hits the prefix cache
        assert _outputs(spec, requests) == expected
    stats = spec.stats()
    assert stats.spec_num_draft_tokens > 0
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens, stats
    assert stats.num_preemptions > 0
    assert_pool_whole(spec.engine)
    _assert_draft_pool_whole(spec)


@pytest.mark.parametrize("k", [1, 3])
def test_draft_model_that_disagrees_keeps_the_outputs(tiny_model_factory, k):
    """Another model of the vocabulary as the draft: proposals are rejected, the draft's
    cache is cut back to what the target kept, and the outputs stay the target's own."""
    model_dir = tiny_model_factory("llama")
    other = tiny_model_factory("qwen2", seed=3)
    base = _llm(model_dir, "llama")
    spec = _llm(model_dir, "llama", speculative_config=_draft(other, k))
    requests = _requests(base, base.engine.model_config.vocab_size)
    assert _outputs(spec, requests) == _outputs(base, requests)
    stats = spec.stats()
    assert 0 <= stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens, stats
    assert_pool_whole(spec.engine)
    _assert_draft_pool_whole(spec)


def test_draft_model_of_another_vocabulary_is_refused(tiny_model_factory):
    model_dir = tiny_model_factory("llama")
    with pytest.raises(ValueError, match=r"speculative_config.model: .*\(\d+ tokens\).* \d+"):
        _llm(model_dir, "llama", speculative_config=_draft("tiny"))
