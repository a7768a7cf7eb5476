"""vLLM's sampling habits: top_k 0 is off, include_stop_str_in_output, skip_special_tokens,
stop_reason, and LLM.get_tokenizer(); in process and through an engine in its own process."""

from __future__ import annotations

import pytest
import torch

from mini_paged_attn.engine import LLM, SamplingParams

GREEDY = dict(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPT = "Blocks of sixteen tokens"


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny", device="cpu", num_kv_blocks=64, max_model_len=128, max_num_seqs=4) as llm:
        yield llm


def _one(llm, **params):
    return llm.generate(PROMPT, SamplingParams(**params), use_tqdm=False)[0].outputs[0]


def test_top_k_zero_is_off_like_minus_one(llm):
    params = SamplingParams(top_k=0, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    assert params.top_k == -1 and not params.uses_filters
    off = SamplingParams(top_k=-1, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    a = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate(PROMPT, off, use_tqdm=False)[0].outputs[0].token_ids
    assert list(a) == list(b)


@pytest.mark.parametrize("field, value", [("top_k", -2), ("include_stop_str_in_output", 1),
                                          ("skip_special_tokens", None)])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def _a_stop_string(llm) -> tuple[str, str]:
    """(the full greedy text, a stop string found in its middle)."""
    text = _one(llm, **GREEDY).text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), text
    return text, stop


def test_stop_string_is_the_stop_reason_and_included_when_asked(llm):
    full, stop = _a_stop_string(llm)
    at = full.find(stop)
    cut = _one(llm, **GREEDY, stop=[stop])
    kept = _one(llm, **GREEDY, stop=[stop], include_stop_str_in_output=True)
    assert cut.text == full[:at] and cut.finish_reason == "stop" and cut.stop_reason == stop
    assert kept.text == full[:at + len(stop)]
    assert kept.stop_reason == stop and kept.token_ids == cut.token_ids


def test_stop_token_id_is_the_stop_reason_and_its_text_included_when_asked(llm):
    ids = list(_one(llm, **GREEDY).token_ids)
    stop_id = ids[4]
    first = ids.index(stop_id)
    tok = llm.tokenizer
    cut = _one(llm, **GREEDY, stop_token_ids=[stop_id])
    kept = _one(llm, **GREEDY, stop_token_ids=[stop_id], include_stop_str_in_output=True)
    assert list(cut.token_ids) == ids[:first + 1]
    assert cut.stop_reason == stop_id and kept.stop_reason == stop_id
    assert cut.text == tok.decode(ids[:first])
    assert kept.text == tok.decode(ids[:first + 1])


def test_length_and_eos_leave_stop_reason_none(llm):
    out = _one(llm, **GREEDY)
    assert out.finish_reason == "length" and out.stop_reason is None


def _forced_special(llm) -> tuple[int, str, dict]:
    """A special token, its text, and params that generate it 3 times (ignore_eos: it may be
    the eos)."""
    hf = llm.get_tokenizer()
    token_id = hf.all_special_ids[0]
    return token_id, hf.convert_ids_to_tokens([token_id])[0], dict(
        GREEDY, max_tokens=3, logit_bias={token_id: 100.0})


def test_skip_special_tokens_false_keeps_them_in_the_text(llm):
    token_id, special, forced = _forced_special(llm)
    skipped = _one(llm, **forced)
    kept = _one(llm, **forced, skip_special_tokens=False)
    assert list(kept.token_ids) == [token_id] * 3
    assert special not in skipped.text
    assert kept.text == special * 3


def test_streamed_text_follows_the_same_rules(llm):
    full, stop = _a_stop_string(llm)
    params = SamplingParams(**GREEDY, stop=[stop], include_stop_str_in_output=True)
    streamed = "".join(llm.stream(PROMPT, params))
    assert streamed == full[:full.find(stop) + len(stop)]


def test_get_tokenizer_is_the_hugging_face_tokenizer(llm):
    from transformers import PreTrainedTokenizerBase

    hf = llm.get_tokenizer()
    assert isinstance(hf, PreTrainedTokenizerBase)
    assert hf.encode(PROMPT) == llm.tokenizer.encode(PROMPT)


def test_an_engine_in_its_own_process_reports_the_same(llm):
    from helpers.engine_clients import run_requests

    from mini_paged_attn.engine.process.mp_client import MPEngineClient

    full, stop = _a_stop_string(llm)
    ids = list(_one(llm, **GREEDY).token_ids)
    cases = [dict(GREEDY, stop=[stop], include_stop_str_in_output=True),
             dict(GREEDY, stop_token_ids=[ids[4]]),
             dict(_forced_special(llm)[2], skip_special_tokens=False)]
    expected = [_one(llm, **c) for c in cases]
    client = MPEngineClient("tiny", dict(device="cpu", num_kv_blocks=64, max_model_len=128,
                                         max_num_seqs=4))
    try:
        got = [r.outputs[0] for r in
               run_requests(client, [(PROMPT, SamplingParams(**c)) for c in cases])]
    finally:
        client.shutdown()
    for want, out in zip(expected, got):
        assert (out.text, out.stop_reason, list(out.token_ids)) == \
            (want.text, want.stop_reason, list(want.token_ids))


def test_logprobs_are_vllm_logprob_objects_and_still_the_floats(llm):
    import json
    import math
    import pickle

    from mini_paged_attn.engine import Logprob

    out = llm.generate(PROMPT, SamplingParams(**GREEDY, logprobs=3, prompt_logprobs=2),
                       use_tqdm=False)[0]
    sample = out.outputs[0]
    hf = llm.get_tokenizer()
    for token_id, entries in zip(sample.token_ids, sample.logprobs):
        assert all(isinstance(e, Logprob) for e in entries.values())
        assert entries[token_id].rank == 1      # greedy: the sampled token is the top one
        ranks = sorted(e.rank for e in entries.values())
        assert ranks == list(range(1, len(entries) + 1))
        by_rank = sorted(entries.values(), key=lambda e: e.rank)
        assert [e.logprob for e in by_rank] == sorted((float(e) for e in by_rank), reverse=True)
        for tid, e in entries.items():
            assert e.decoded_token == hf.decode([tid], skip_special_tokens=False)
            assert e == e.logprob and type(e.logprob) is float and math.exp(e) <= 1.0
    total = sum(e[t] for t, e in zip(sample.token_ids, sample.logprobs))
    assert math.isclose(total, sample.cumulative_logprob, rel_tol=1e-5, abs_tol=1e-5)
    assert json.loads(json.dumps({"x": sample.logprobs[0][sample.token_ids[0]]}))["x"] == \
        sample.logprobs[0][sample.token_ids[0]].logprob
    again = pickle.loads(pickle.dumps(sample.logprobs[0]))
    assert {t: (e.logprob, e.rank, e.decoded_token) for t, e in again.items()} == \
        {t: (e.logprob, e.rank, e.decoded_token) for t, e in sample.logprobs[0].items()}
    assert out.prompt_logprobs[0] is None
    for token_id, entries in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert token_id in entries and all(isinstance(e, Logprob) for e in entries.values())


def test_sampled_and_prompt_tokens_have_their_rank_in_the_vocabulary(tiny_model_factory):
    """vLLM's rank: 1 + the tokens strictly more likely, in the whole vocabulary, for a
    sampled token outside the top ones too; checked against transformers' log-softmax."""
    from helpers.tiny_models import hf_logits, hf_reference_model, random_prompts

    model_dir = tiny_model_factory("llama")
    hf = hf_reference_model(model_dir)
    prompt = random_prompts(hf.config.vocab_size, [9], seed=3)[0]
    with LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=16,
             max_model_len=64) as llm:
        out = llm.generate({"prompt_token_ids": prompt},
                           SamplingParams(temperature=1.5, seed=7, max_tokens=16,
                                          ignore_eos=True, logprobs=1, prompt_logprobs=1),
                           use_tqdm=False)[0]
    sample = out.outputs[0]
    ids = prompt + list(sample.token_ids)
    reference = torch.log_softmax(hf_logits(hf, ids), dim=-1)   # row t: the token t + 1
    outside = 0
    for at, entries in [*zip(range(1, len(prompt)), out.prompt_logprobs[1:]),
                        *zip(range(len(prompt), len(ids)), sample.logprobs)]:
        token, row = ids[at], reference[at - 1]
        want = int((row > row[token]).sum()) + 1
        # Float noise between the two forwards may move a token past a near-tie.
        close = int((row > row[token] + 1e-4).sum()) + 1, int((row >= row[token] - 1e-4).sum())
        assert close[0] <= entries[token].rank <= close[1], (at, entries[token].rank, want)
        outside += want > 1
    assert outside >= 3      # temperature 1.5: several picks are not the most likely


def test_an_entry_ranked_by_the_sampler_keeps_its_rank():
    from mini_paged_attn.engine.outputs import Logprob, logprob_objects

    entries = logprob_objects({5: -0.1, 7: Logprob(-3.0, 412)}, 1, str)
    assert (entries[5].rank, entries[7].rank) == (1, 412)
    assert entries[7].decoded_token == "7" and entries[7] == -3.0
    assert logprob_objects({5: -0.1, 7: -3.0}, 1, str)[7].rank is None


def test_token_ranks_count_the_strictly_more_likely_tokens():
    from mini_paged_attn.engine.sample.sampler import token_ranks

    gen = torch.Generator().manual_seed(0)
    logprobs = torch.log_softmax(torch.randn(6, 50, generator=gen), dim=-1)
    logprobs[2, :10] = logprobs[2, 10]            # ties: none of them counts as above
    picks = torch.tensor([0, 7, 10, 49, 3, 25])
    chosen = logprobs.gather(1, picks[:, None])[:, 0]
    order = logprobs.argsort(dim=-1, descending=True)
    got = token_ranks(logprobs, chosen).tolist()
    for r, pick in enumerate(picks.tolist()):
        above = sum(1 for t in order[r].tolist() if logprobs[r, t] > logprobs[r, pick])
        assert got[r] == above + 1


def test_tokenizer_of_another_directory_replaces_the_model_s(tiny_model_factory, tmp_path):
    from transformers import AutoTokenizer

    model_dir = tiny_model_factory("llama")
    hf = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    hf.chat_template = "{% for m in messages %}({{ m['content'] }}){% endfor %}"
    hf.save_pretrained(str(tmp_path / "tok"))
    with LLM(str(model_dir), device="cpu", num_kv_blocks=16, max_model_len=64,
             tokenizer=str(tmp_path / "tok")) as llm:
        assert llm.get_tokenizer().chat_template == hf.chat_template
        text = llm.tokenizer.apply_chat_template([{"role": "user", "content": "x"}],
                                                 tokenize=False)
    assert text == "(x)"
    with pytest.raises(FileNotFoundError, match="tokenizer|model_dir"):
        LLM(str(model_dir), device="cpu", tokenizer=str(tmp_path / "nothing"))
