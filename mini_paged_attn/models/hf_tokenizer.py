"""Which transformers class loads a model directory's tokenizer, and loading it.

``AutoTokenizer`` reads the directory's config.json through transformers' config classes,
which import its auto-model stack (generation, masking, accelerate, ``torch.distributed``:
seconds of a server's start, most of them on a GPU host). What it then builds is, for most
directories, the tokenizer class that tokenizer_config.json names, from that class's own
``from_pretrained``. So a directory whose tokenizer_config.json names transformers' base fast
class (``PreTrainedTokenizerFast``, ``TokenizersBackend`` in transformers 5) beside a
tokenizer.json is loaded with that class directly, which loads tokenizer.json as it is, with
tokenizer_config.json's settings (special tokens, chat template, ``add_bos_token``, ...).

Every other directory goes through ``AutoTokenizer``, as do those for which it would pick
another class than the named one:

- a tokenizer class of a model family (Qwen2Tokenizer, LlamaTokenizer, GPT2Tokenizer,
  GemmaTokenizer, ...): in transformers 5 these rebuild the tokenizer from tokenizer.json's
  vocabulary and merges with their own normaliser, pre-tokeniser and post-processor;
- an ``auto_map`` (the checkpoint's own code) or a ``tekken.json`` (Mistral's format, which
  transformers 5 loads with mistral-common when it is installed);
- a config.json whose model type transformers 5 gives its own tokenizer class whatever the
  file names (``Family.own_tokenizer_class``: Qwen2), or a model type no registered family has
  (not verified).

``tests/models/test_hf_tokenizer.py`` holds both paths to ``AutoTokenizer``'s results.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def auto_tokenizer_reason(model_dir: Path, base_class_names: tuple[str, ...]) -> str | None:
    """Why ``model_dir``'s tokenizer must load through ``AutoTokenizer`` (None: the base
    class, whose names in this transformers are ``base_class_names``, gives the same)."""
    if not (model_dir / "tokenizer.json").is_file():
        return "no tokenizer.json"
    tokenizer_config = _json_object(model_dir / "tokenizer_config.json")
    if tokenizer_config is None:
        return "no readable tokenizer_config.json"
    named = tokenizer_config.get("tokenizer_class")
    if named not in base_class_names:
        return f"tokenizer_class {named!r}"
    if "auto_map" in tokenizer_config:
        return "an auto_map"
    if (model_dir / "tekken.json").is_file():
        return "a tekken.json"
    if not (model_dir / "config.json").is_file():
        return None
    config = _json_object(model_dir / "config.json")
    if config is None:
        return "config.json does not parse"
    model_type = config.get("model_type")
    if model_type is None:
        return None
    from .registry import REGISTRY

    family = next((f for f in REGISTRY.families if f.model_type == model_type), None)
    if family is None:
        return f"model_type {model_type!r} of no registered family"
    if family.own_tokenizer_class is not None:
        return f"model_type {model_type!r} (transformers 5: {family.own_tokenizer_class})"
    return None


def load_hf_tokenizer(model_dir: Path) -> Any:
    """The transformers tokenizer of the local directory ``model_dir`` (nothing downloaded):
    what ``AutoTokenizer.from_pretrained`` gives, loaded without it where that is the same
    (module docstring). Logs at DEBUG which way it loaded."""
    from transformers import PreTrainedTokenizerFast

    names = tuple(dict.fromkeys(("PreTrainedTokenizerFast", PreTrainedTokenizerFast.__name__)))
    reason = auto_tokenizer_reason(model_dir, names)
    if reason is None:
        logger.debug("%s: tokenizer loaded as %s", model_dir, PreTrainedTokenizerFast.__name__)
        return PreTrainedTokenizerFast.from_pretrained(str(model_dir), local_files_only=True)
    logger.debug("%s: tokenizer loaded through AutoTokenizer (%s)", model_dir, reason)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def _json_object(path: Path) -> dict | None:
    """The JSON object in ``path``; None when it is missing or is not one (``AutoTokenizer``
    then says what is wrong with it)."""
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None


__all__ = ["auto_tokenizer_reason", "load_hf_tokenizer"]
