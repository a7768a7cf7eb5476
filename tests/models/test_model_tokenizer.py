"""Tokenizer wrapper (local dir, chat template, eos ids) and IncrementalDetokenizer."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from mini_paged_attn.models.tiny import byte_level_hf_tokenizer
from mini_paged_attn.models.tokenizer import Tokenizer, load_tokenizer

TEXT = "Hello 你好, paged world! 🙂🚀 ✨ done."
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好 🙂"}]


@pytest.fixture(scope="module")
def tok(tiny_model_factory):
    return load_tokenizer(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def byte_tok():
    return Tokenizer(byte_level_hf_tokenizer())


def test_encode_decode_and_ids(tok):
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    assert len(ids) < len(TEXT.encode())                      # merges: tokens span several bytes
    assert tok.eos_token_ids == (0, 2) and tok.eos_token_id == 0  # tokenizer's + config's
    assert tok.vocab_size == 300
    with pytest.raises(ValueError, match="text"):
        tok.encode(["not", "a", "string"])


def test_chat_template_matches_transformers(tok, tiny_model_factory):
    hf = AutoTokenizer.from_pretrained(tiny_model_factory("llama"))
    text = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.apply_chat_template(MESSAGES, tokenize=False) == text
    ids = tok.apply_chat_template(MESSAGES)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert ids[0] == tok.hf.convert_tokens_to_ids("<|im_start|>")  # specials stay single tokens
    with pytest.raises(ValueError, match="messages"):
        tok.apply_chat_template([{"content": "no role"}])


def test_no_chat_template_and_missing_files(tmp_path):
    hf = byte_level_hf_tokenizer()
    hf.chat_template = None
    plain = Tokenizer(hf, name="plain")
    with pytest.raises(ValueError, match="no chat template"):
        plain.apply_chat_template(MESSAGES)
    with pytest.raises(FileNotFoundError, match="is empty"):
        load_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_tokenizer(tmp_path / "nowhere")


def test_byte_tokenizer_ids_are_bytes(byte_tok):
    ids = byte_tok.encode("aé🙂")
    assert ids == list("aé🙂".encode())
    assert byte_tok.decode(ids + [258]) == "aé🙂"
    assert byte_tok.decode([258], skip_special_tokens=False) == "<|im_end|>"


def stream(tok, ids, prompt=()):
    detok = tok.detokenizer(prompt)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.text and detok.token_ids == list(ids)
    return deltas


@pytest.mark.parametrize("which", ["bpe", "bytes"])
def test_detokenizer_holds_back_split_characters(which, tok, byte_tok):
    t = tok if which == "bpe" else byte_tok
    ids = t.encode(TEXT)
    deltas = stream(t, ids)
    assert "".join(deltas) == TEXT
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas[:-1]                  # some token carried half a character: held back


def test_detokenizer_with_prompt_context_emits_only_new_text(tok):
    prompt = tok.encode("Question: 你好?")
    gen = tok.encode(" Answer: 🙂 ok")
    assert "".join(stream(tok, gen, prompt)) == " Answer: 🙂 ok"


def test_detokenizer_skips_special_tokens(tok):
    ids = tok.encode("hi") + [2] + tok.encode(" there")
    assert "".join(stream(tok, ids)) == "hi there"


def test_detokenizer_flush_releases_a_dangling_partial_character(byte_tok):
    deltas = stream(byte_tok, list("ok🙂".encode())[:-1])
    assert deltas[-1] == "\ufffd" and "".join(deltas) == "ok\ufffd"


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, 299), max_size=40), split=st.integers(0, 40))
def test_detokenizer_equals_full_decode_on_any_ids(tok, ids, split):
    prompt, gen = ids[:split], ids[split:]
    full = tok.decode(prompt + gen)
    head = tok.decode(prompt)
    text = "".join(stream(tok, gen, prompt))
    if not head.endswith("\ufffd"):
        assert head + text == full
    else:
        # A prompt ending in half a character: only the continuation is ours to print.
        assert full.endswith(text)
