"""load_tokenizer without AutoTokenizer (``models/hf_tokenizer.py``): the same tokenizer as
``AutoTokenizer.from_pretrained`` gives, for every tokenizer the test suite writes, with each
family's config.json beside it, and through AutoTokenizer where the base class would differ."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from helpers.tiny_models import tiny_tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from mini_paged_attn.models.hf_tokenizer import auto_tokenizer_reason
from mini_paged_attn.models.registry import REGISTRY
from mini_paged_attn.models.tiny import byte_level_hf_tokenizer, write_tokenizer_files
from mini_paged_attn.models.tokenizer import Tokenizer, load_tokenizer

TEXTS = ["Hello  world\n\n  你好，世界 🙂🚀 e\u0301 Ａ1000 ", " leading space",
         "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>", "", "\t\r\n  trailing  "]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好 🙂"},
            {"role": "assistant", "content": " ok "}, {"role": "user", "content": "more"}]
BASE_NAMES = tuple(dict.fromkeys(("PreTrainedTokenizerFast", PreTrainedTokenizerFast.__name__)))


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def _bpe(path: Path, model_type: str | None = None, **tokenizer_config) -> Path:
    """The tiny models' tokenizer files (tests/helpers/tiny_models.py), with a config.json of
    ``model_type`` beside them and ``tokenizer_config`` changed."""
    write_tokenizer_files(tiny_tokenizer(), path)
    if model_type is not None:
        (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    _edit_json(path / "tokenizer_config.json", **tokenizer_config)
    return path


def _native(path: Path) -> Path:
    """The tokenizer as transformers saves it itself (5.x: ``TokenizersBackend``)."""
    hf = tiny_tokenizer()
    hf.save_pretrained(path)
    return path


def _no_template(path: Path) -> Path:
    _bpe(path, "qwen3", chat_template=None)
    (path / "chat_template.jinja").unlink(missing_ok=True)    # transformers 5 writes it too
    return path


def _bytes(path: Path) -> Path:
    write_tokenizer_files(byte_level_hf_tokenizer(), path)   # the embedded tiny model's
    return path


# name -> (writer, whether it loads without AutoTokenizer)
CASES = {
    **{f"bpe-{f.name}": (lambda p, t=f.model_type: _bpe(p, t), f.own_tokenizer_class is None)
       for f in REGISTRY.families},
    "bpe-no-config": (_bpe, True),
    "bytes": (_bytes, True),
    "native-save": (_native, True),
    "bos-eos-cleanup": (lambda p: _bpe(p, "llama", add_bos_token=True, add_eos_token=True,
                                       clean_up_tokenization_spaces=True, pad_token="<|im_end|>"),
                        True),
    "no-chat-template": (_no_template, True),
    "no-tokenizer-class": (lambda p: _bpe(p, "qwen3", tokenizer_class=None), False),
    "other-model-type": (lambda p: _bpe(p, "deepseek_v3"), False),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    writer, direct = CASES[request.param]
    return request.param, writer(tmp_path_factory.mktemp(request.param)), direct


def _same(ours: Tokenizer, auto, vocab: int) -> None:
    theirs = Tokenizer(auto)
    assert type(ours.hf) is type(auto)
    assert len(ours.hf) == len(auto) and ours.hf.get_vocab() == auto.get_vocab()
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id",
                 "all_special_ids", "add_bos_token", "add_eos_token",
                 "clean_up_tokenization_spaces", "chat_template"):
        assert getattr(ours.hf, name, None) == getattr(auto, name, None), name
    assert ours.eos_token_ids == theirs.eos_token_ids
    ids = list(range(vocab))
    assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
    for text in TEXTS:
        for special in (True, False):
            encoded = ours.encode(text, add_special_tokens=special)
            assert encoded == auto.encode(text, add_special_tokens=special), (text, special)
    for some in (ids, ids[::-7], [0, 5, 1, 9, 2, 2, 30]):
        for skip in (True, False):
            assert ours.decode(some, skip_special_tokens=skip) == \
                auto.decode(some, skip_special_tokens=skip), skip
            assert ours.decode(some, skip_special_tokens=skip) == \
                theirs.decode(some, skip_special_tokens=skip)
    if auto.chat_template:
        for prompt in (True, False):
            text = ours.apply_chat_template(MESSAGES, add_generation_prompt=prompt,
                                            tokenize=False)
            assert text == auto.apply_chat_template(MESSAGES, add_generation_prompt=prompt,
                                                    tokenize=False)
            assert ours.apply_chat_template(MESSAGES, add_generation_prompt=prompt) == \
                auto.encode(text, add_special_tokens=False)
    else:
        assert not ours.has_chat_template


def test_the_tokenizer_is_autotokenizers(case, caplog):
    _, path, direct = case
    with caplog.at_level(logging.DEBUG, logger="mini_paged_attn.models.hf_tokenizer"):
        ours = load_tokenizer(path)
    way = [r.getMessage() for r in caplog.records if "tokenizer loaded" in r.getMessage()]
    assert len(way) == 1 and ("through AutoTokenizer" not in way[0]) == direct, way
    auto = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    _same(ours, auto, len(auto))


@pytest.mark.parametrize("family", [f.name for f in REGISTRY.families])
def test_a_family_whose_autotokenizer_picks_another_class_declares_it(family, tmp_path):
    """Where transformers' AutoTokenizer swaps the named base class for the model type's own,
    the family says so (and its tokenizers go through AutoTokenizer)."""
    spec = REGISTRY.by_name(family)
    auto = AutoTokenizer.from_pretrained(str(_bpe(tmp_path, spec.model_type)),
                                         local_files_only=True)
    if type(auto) is not PreTrainedTokenizerFast:
        assert spec.own_tokenizer_class == type(auto).__name__
    assert (auto_tokenizer_reason(tmp_path, BASE_NAMES) is None) == \
        (spec.own_tokenizer_class is None)


@pytest.mark.parametrize("change, reason", [
    ({"tokenizer_class": "Qwen2Tokenizer"}, "tokenizer_class 'Qwen2Tokenizer'"),
    ({"auto_map": {"AutoTokenizer": [None, "x.Tok"]}}, "auto_map"),
])
def test_what_autotokenizer_would_load_otherwise_goes_through_it(tmp_path, change, reason):
    _bpe(tmp_path, "llama", **change)
    assert reason in auto_tokenizer_reason(tmp_path, BASE_NAMES)
    (tmp_path / "tokenizer_config.json").write_text("[]")
    assert "tokenizer_config.json" in auto_tokenizer_reason(tmp_path, BASE_NAMES)


def test_mistral_format_and_missing_files_go_through_autotokenizer(tmp_path):
    _bpe(tmp_path, "mistral")
    assert auto_tokenizer_reason(tmp_path, BASE_NAMES) is None
    (tmp_path / "tekken.json").write_text("{}")
    assert "tekken.json" in auto_tokenizer_reason(tmp_path, BASE_NAMES)
    (tmp_path / "tekken.json").unlink()
    (tmp_path / "config.json").write_text("{not json")
    assert "config.json" in auto_tokenizer_reason(tmp_path, BASE_NAMES)
    (tmp_path / "tokenizer.json").unlink()
    assert auto_tokenizer_reason(tmp_path, BASE_NAMES) == "no tokenizer.json"
