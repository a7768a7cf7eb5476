"""The prompt forms the engine takes, as vLLM's ``vllm.inputs`` names them, and their parsing.

A prompt is one of:

- a ``str``: text, tokenized with the model's tokenizer;
- a list (or tuple) of ``int`` token ids;
- :class:`TextPrompt` ``{"prompt": str}``;
- :class:`TokensPrompt` ``{"prompt_token_ids": list[int]}``.

A batch is a list (or tuple) of those. Anything else is a ``TypeError`` naming the argument
(a dict with other keys or with both keys, ids that are not ints, ...): a form read as
something else would generate from the wrong prompt without a word. Token ids are checked
against the vocabulary later, where it is known (``admission.py``: a ``ValueError``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypedDict

_PROMPT_KEYS = ("prompt", "prompt_token_ids")


class TextPrompt(TypedDict):
    """A text prompt: ``{"prompt": "Hello"}``."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt of token ids: ``{"prompt_token_ids": [1, 2, 3]}``."""

    prompt_token_ids: list[int]


PromptType = str | list[int] | TextPrompt | TokensPrompt


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r:.80}"


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(value: Any, name: str) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name}: expected a list of int token ids, got {_describe(value)}")
    bad = next((i for i, t in enumerate(value) if not _is_token_id(t)), None)
    if bad is not None:
        raise TypeError(f"{name}[{bad}]: expected an int token id, got {_describe(value[bad])}")
    return list(value)


def parse_prompt(prompt: Any, name: str = "prompt") -> str | list[int]:
    """One prompt in any of the forms of the module docstring, as text or a list of token ids.

    Raises:
        TypeError: ``prompt`` is of none of those forms (the message names ``name``, the
            expected forms and what arrived).
    """
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)):
        return _token_ids(prompt, name)
    if isinstance(prompt, dict):
        keys = set(prompt)
        if len(keys) != 1 or not keys <= set(_PROMPT_KEYS):
            raise TypeError(f"{name}: expected a dict with exactly one of the keys "
                            f"{list(_PROMPT_KEYS)} (TextPrompt or TokensPrompt), got keys "
                            f"{sorted(map(str, keys))}")
        if "prompt" in prompt:
            text = prompt["prompt"]
            if not isinstance(text, str):
                raise TypeError(f"{name}['prompt']: expected a str, got {_describe(text)}")
            return text
        return _token_ids(prompt["prompt_token_ids"], f"{name}['prompt_token_ids']")
    raise TypeError(f"{name}: expected a str, a list of int token ids, {{'prompt': str}} or "
                    f"{{'prompt_token_ids': [int, ...]}}, got {_describe(prompt)}")


def parse_prompts(prompts: Any, name: str = "prompts") -> list[str | list[int]]:
    """One prompt or a batch of them (see the module docstring), as a list of texts and token
    id lists. A list whose entries are all ints is one prompt of token ids; an empty list is
    an empty batch.

    Raises:
        TypeError: ``prompts`` or one of its entries is of no known form (named as
            ``prompts[i]``).
    """
    if isinstance(prompts, (str, dict)):
        return [parse_prompt(prompts, name)]
    if not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, bytearray)):
        raise TypeError(f"{name}: expected a prompt or a list of prompts, got "
                        f"{_describe(prompts)}")
    if prompts and all(_is_token_id(t) for t in prompts):
        return [list(prompts)]
    return [parse_prompt(p, f"{name}[{i}]") for i, p in enumerate(prompts)]


__all__ = ["PromptType", "TextPrompt", "TokensPrompt", "parse_prompt", "parse_prompts"]
