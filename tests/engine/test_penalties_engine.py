"""Penalties, logit_bias, min_tokens and stop_token_ids through the engine on a tiny Llama:
greedy tokens equal transformers' logits processed by a plain per-token reference, with n=2
samples, preemption and chunked prefill in the way."""

from __future__ import annotations

import pytest
import torch
from helpers.sampling_reference import reference_logits
from helpers.tiny_models import hf_reference_model

from mini_paged_attn.engine import LLM, SamplingParams
from helpers import engines
from helpers.engines import assert_pool_whole

MAX_TOKENS = 8
PROMPT_LENS = (3, 9, 17)


@pytest.fixture(scope="module")
def llama(tiny_model_factory):
    model_dir = tiny_model_factory("llama")
    hf = hf_reference_model(model_dir)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=gen).tolist()
               for n in PROMPT_LENS]
    return model_dir, hf, prompts


def reference_greedy(hf, prompt: list[int], params: SamplingParams,
                     stop_ids: frozenset[int]) -> list[int]:
    """Greedy decoding over transformers' logits, each step processed by the reference."""
    output: list[int] = []
    while len(output) < params.max_tokens:
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + output])).logits[0, -1].float()
        processed = reference_logits(logits.tolist(), params, prompt, output, stop_ids)
        token = int(torch.tensor(processed).argmax())
        output.append(token)
        if token in stop_ids:
            break
    return output


CASES = {
    "penalties": SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                presence_penalty=0.5, frequency_penalty=1.0,
                                repetition_penalty=1.5),
    "repetition-below-one": SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                           ignore_eos=True, repetition_penalty=0.3),
    "bias": SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                           logit_bias={5: 3.0, 6: -100.0, 7: 0.5}),
    "everything": SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=4,
                                 stop_token_ids=[10, 11], presence_penalty=-1.0,
                                 frequency_penalty=0.25, logit_bias={10: 0.5, 11: 0.5}),
}
VARIANTS = {
    "plain": dict(),
    "preemption": dict(num_kv_blocks=9),
    "chunked-prefill": dict(max_num_batched_tokens=5),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_with_processors_matches_the_reference(llama, case, variant):
    model_dir, hf, prompts = llama
    options = dict(block_size=4, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=256,
                   max_model_len=64)
    engine = engines.make_engine(model_dir, **{**options, **VARIANTS[variant]})
    params = CASES[case]
    stop = frozenset(params.stop_token_ids)
    if not params.ignore_eos:
        stop |= engine.eos_token_ids
    expected = [reference_greedy(hf, p, params, stop) for p in prompts]
    llm = LLM.from_engine(engine)
    plain = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    # Next to requests that use none of it (and n=2: both samples follow the reference).
    two = SamplingParams(**{**_fields(params), "n": 2})
    outputs = llm.generate(prompts + prompts[:1], [params] * 2 + [two, plain], use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outputs[:3]]
    assert got == expected
    assert outputs[2].outputs[1].token_ids == expected[2]
    assert len(engine.runner.sampler.history) == 0
    if variant == "preemption":
        assert llm.stats().num_preemptions > 0
    assert_pool_whole(engine)


def _fields(params: SamplingParams) -> dict:
    return {k: getattr(params, k) for k in ("temperature", "max_tokens", "ignore_eos",
                                            "presence_penalty", "frequency_penalty",
                                            "repetition_penalty", "logit_bias", "min_tokens",
                                            "stop_token_ids")}


def test_min_tokens_holds_off_eos_and_stop_token_ids(llama):
    model_dir, hf, prompts = llama
    engine = engines.make_engine(model_dir, block_size=4, num_kv_blocks=64, max_num_seqs=8,
                                 max_num_batched_tokens=256, max_model_len=64)
    llm = LLM.from_engine(engine)
    # A bias makes token 9 the likeliest by far: a stop token, it ends the sample at once ...
    forced = dict(temperature=0.0, max_tokens=6, logit_bias={9: 100.0}, stop_token_ids=[9])
    out = llm.generate(prompts[:1], SamplingParams(**forced), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [9] and out.finish_reason == "stop" and out.text == ""
    # ... unless min_tokens holds it off: then it is the 4th token.
    out = llm.generate(prompts[:1], SamplingParams(**forced, min_tokens=3),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4 and out.token_ids[-1] == 9 and 9 not in out.token_ids[:3]
    assert out.finish_reason == "stop"
    # EOS (id 0) likewise, and with ignore_eos it is no stop token at all.
    eos = dict(temperature=0.0, max_tokens=6, logit_bias={0: 100.0})
    out = llm.generate(prompts[:1], SamplingParams(**eos, min_tokens=2), use_tqdm=False)
    assert out[0].outputs[0].token_ids[2] == 0 and 0 not in out[0].outputs[0].token_ids[:2]
    out = llm.generate(prompts[:1], SamplingParams(**eos, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == [0] * 6


def test_logit_bias_outside_the_vocabulary_is_refused_at_admission(llama):
    model_dir, _, prompts = llama
    engine = engines.make_engine(model_dir, block_size=4, num_kv_blocks=16, max_num_seqs=2,
                                 max_model_len=32)
    vocab = engine.model_config.vocab_size
    with pytest.raises(ValueError, match="^logit_bias: token id"):
        engine.add_request(prompts[0], SamplingParams(logit_bias={vocab: 1.0}))
    assert not engine.has_unfinished_requests()
