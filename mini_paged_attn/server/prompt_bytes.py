"""A prompt too long for the context, found from its byte length before it is tokenized.

Tokenizing megabytes of text takes seconds of a request worker; a prompt that cannot fit in
``max_model_len`` tokens should not get them. The rule: no token of the vocabulary stands for
more than ``L`` bytes of text, so a text of ``b`` UTF-8 bytes has at least ``ceil(b / L)``
tokens, and a prompt of more than ``max_model_len * L`` bytes cannot fit. ``L`` is the longest
vocabulary entry in UTF-8 bytes, at least 4 (an unknown character is at most one token of 4
bytes). The entries overstate what they stand for (byte-level BPE writes a byte as one or two
UTF-8 bytes, SentencePiece a space as the 3-byte "▁", a byte-fallback token as "<0xE3>"), which
only raises the cap, so the rule never refuses a prompt that would fit, unless the tokenizer's
normalizer deletes characters (none of the families served here does). Chat messages: their
texts sum to no more bytes than the rendered template, which holds them all.

>>> prompt_byte_cap(None, 2048) is None
True
"""

from __future__ import annotations

from typing import Any

from .errors import bad_request

# An unknown character becomes at most one token.
_MIN_BYTES_PER_TOKEN = 4


def prompt_byte_cap(tokenizer: Any, max_model_len: int) -> int | None:
    """The byte length over which a prompt cannot fit in ``max_model_len`` tokens, or None when
    the tokenizer does not show its vocabulary (no cap then)."""
    get_vocab = getattr(getattr(tokenizer, "hf", None), "get_vocab", None)
    if get_vocab is None:
        return None
    try:
        vocab = get_vocab()
    except Exception:   # a tokenizer without a readable vocabulary: no cap rather than a guess
        return None
    longest = max((len(entry.encode("utf-8", "replace")) for entry in vocab), default=0)
    return max_model_len * max(longest, _MIN_BYTES_PER_TOKEN)


def check_prompt_bytes(cap: int | None, texts: list[str], param: str, max_model_len: int) -> None:
    """Raise a 400 (``context_length_exceeded``) naming ``param`` if ``texts`` together hold
    more than ``cap`` UTF-8 bytes."""
    if cap is None:
        return
    size = 0
    for text in texts:
        size += len(text.encode("utf-8", "replace"))     # milliseconds for megabytes
        if size > cap:
            raise bad_request(f"{param}: the prompt has more than {cap} bytes of text, more than "
                              f"the model's context of {max_model_len} tokens (max_model_len) "
                              "can hold", param=param, code="context_length_exceeded")
