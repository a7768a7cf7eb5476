"""A GGUF file's tokenizer built from metadata already read (gguf_file.py), not from the file.

``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` reads the file twice more (the whole
metadata for a config, then the vocabulary) before it builds the same tokenizer: transformers'
GGUF tokenizer conversion (``convert_gguf_tokenizer``) over the vocabulary and merges, with
the special tokens and chat template of the metadata. This module feeds that conversion the
metadata the loader has; on a transformers without it, :func:`tokenizer_from_metadata`
returns None and the caller takes the ``AutoTokenizer`` path.
"""

from __future__ import annotations

from typing import Any


def tokenizer_from_metadata(metadata: dict[str, Any]) -> Any | None:
    """transformers' fast tokenizer of a GGUF file with this ``metadata`` (every key, the
    vocabulary and merges in full), or None when this transformers has no such conversion."""
    try:
        from transformers import TokenizersBackend
        from transformers.integrations.gguf import gguf_tokenizer_mapping as mapping
    except ImportError:
        return None
    renames = getattr(mapping, "GGUF_TOKENIZER_MAPPING", None)
    special = getattr(mapping, "_SPECIAL_TOKENS", None)
    if renames is None or special is None:
        return None
    grouped = {group: {name: metadata[f"tokenizer.{key}"] for key, name in keys.items()
                       if f"tokenizer.{key}" in metadata}
               for group, keys in renames.items()}
    tokenizer, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
    if "tokens" not in tokenizer:
        raise ValueError("the GGUF metadata has no tokenizer.ggml.tokens")
    # As transformers' GGUF reader decides it: sentencepiece vocabularies that do not say
    # otherwise get a BOS, as llama.cpp gives them; Gemma 4's chat template writes its own.
    tokenizer_type = tokenizer.get("tokenizer_type")
    if tokenizer_type == "llama":
        tokenizer_config.setdefault("add_bos_token", True)
    elif tokenizer_type == "gemma4":
        tokenizer_config["add_bos_token"] = False
    for name, key in special.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        tokenizer_config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    backend, extra = mapping.convert_gguf_tokenizer(metadata["general.architecture"], tokenizer)
    tokenizer_config.update(extra)
    return TokenizersBackend(tokenizer_object=backend, **tokenizer_config)


__all__ = ["tokenizer_from_metadata"]
