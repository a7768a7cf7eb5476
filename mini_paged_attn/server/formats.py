"""Response objects of the two endpoints, as OpenAI shapes them (streamed chunks and whole).

``text_completion`` for /v1/completions, ``chat.completion`` / ``chat.completion.chunk`` for
/v1/chat/completions. A chunk carries the text and log-probabilities of the tokens that arrived
since the previous chunk of the same choice (``start``: the first of them).

Tool calls (chat with ``tools``): a choice's text that may be a call is held back while it
streams; once the choice finishes, one chunk carries each whole call (``delta.tool_calls``), and
the choice's ``finish_reason`` is "tool_calls".

Each choice also carries vLLM's ``stop_reason``: the stop string or stop token id that ended
it, else null (length, end of sequence, abort, or still running).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..engine.tools.parsers import ToolCallMode


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _finite(x: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number, -9999.0 is what OpenAI itself sends.
    return x if math.isfinite(x) else -9999.0


@dataclass(frozen=True)
class Logprobs:
    """Turns the engine's per-token ``{token_id: logprob}`` dicts into OpenAI's two layouts.

    Args:
        token_text: token id -> its text (for a token that is part of a multi-byte character,
            whatever the tokenizer decodes it to alone).
        top: how many alternatives per token the client asked for.
    """

    token_text: Callable[[int], str]
    top: int

    def _alternatives(self, entry: dict[int, float]) -> list[tuple[int, float]]:
        return sorted(entry.items(), key=lambda kv: -kv[1])[:self.top]

    def completion(self, comp: Any, start: int, text_offset: int) -> dict[str, Any] | None:
        """The ``logprobs`` object of a text_completion choice for tokens ``start:``."""
        if comp.logprobs is None:
            return None
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for tid, entry in zip(comp.token_ids[start:], comp.logprobs[start:]):
            text = self.token_text(tid)
            tokens.append(text)
            token_logprobs.append(_finite(entry[tid]))
            top: dict[str, float] = {}
            for t, lp in self._alternatives(entry):  # tokens of one text: keep the likeliest
                top.setdefault(self.token_text(t), _finite(lp))
            top_logprobs.append(top)
            offsets.append(text_offset)
            text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs,
                "top_logprobs": top_logprobs, "text_offset": offsets}

    def prompt_completion(self, token_ids: list[int],
                          entries: list[dict[int, float] | None]) -> dict[str, Any]:
        """The prompt's part of a text_completion ``logprobs`` object (``echo``): its tokens,
        their logprobs (null for the first, which nothing predicts), offsets from 0."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                "text_offset": []}
        offset = 0
        for tid, entry in zip(token_ids, entries):
            text = self.token_text(tid)
            out["tokens"].append(text)
            out["text_offset"].append(offset)
            offset += len(text)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_finite(entry[tid]))
            top: dict[str, float] = {}
            for t, lp in self._alternatives(entry):
                top.setdefault(self.token_text(t), _finite(lp))
            out["top_logprobs"].append(top)
        return out

    def prompt_by_id(self, token_ids: list[int],
                     entries: list[dict[int, float] | None]) -> list[dict[str, Any] | None]:
        """vLLM's ``prompt_logprobs`` of a choice: per prompt position None (the first) or
        ``{token id (str): {"logprob", "decoded_token"}}`` for the top ones and the prompt's."""
        out: list[dict[str, Any] | None] = []
        for tid, entry in zip(token_ids, entries):
            if entry is None:
                out.append(None)
                continue
            keep = dict(self._alternatives(entry))
            keep[tid] = entry[tid]
            out.append({str(t): {"logprob": _finite(lp), "decoded_token": self.token_text(t)}
                        for t, lp in keep.items()})
        return out

    def _chat_token(self, tid: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(tid)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}

    def chat(self, comp: Any, start: int) -> dict[str, Any] | None:
        """The ``logprobs`` object of a chat choice for tokens ``start:``."""
        if comp.logprobs is None:
            return None
        content = []
        for tid, entry in zip(comp.token_ids[start:], comp.logprobs[start:]):
            item = self._chat_token(tid, entry[tid])
            item["top_logprobs"] = [self._chat_token(t, lp) for t, lp in self._alternatives(entry)]
            content.append(item)
        return {"content": content, "refusal": None}


@dataclass
class ResponseFormat:
    """Builds the response objects of one request of either endpoint.

    ``echo`` (completions): per prompt, the text each of its choices starts with (choice ``i``
    belongs to prompt ``i // n``); None: the choices hold the completion only. With ``echo``
    and ``logprobs``, a choice's logprobs start with the prompt tokens'. ``prompt_logprobs``
    (completions, vLLM's extension): each choice also gets a ``prompt_logprobs`` list. Both
    read the engine's outputs as :meth:`note_prompt` hands them over.
    ``tools`` (chat with tools): how tool calls are read from a choice's text.
    """

    chat: bool
    request_id: str
    model: str
    created: int
    logprobs: Logprobs | None = None
    echo: list[str] | None = None
    n: int = 1
    tools: ToolCallMode | None = None
    prompt_logprobs: Logprobs | None = None
    # prompt index -> (its token ids, the engine's prompt logprobs or None)
    _prompts: dict[int, tuple[list[int], list | None]] = field(default_factory=dict)

    def note_prompt(self, prompt_index: int, out: Any) -> None:
        """Keep the prompt side of ``out`` (a RequestOutput) for the choices of that prompt."""
        if prompt_index not in self._prompts or self._prompts[prompt_index][1] is None:
            self._prompts[prompt_index] = (out.prompt_token_ids, out.prompt_logprobs)

    def _prompt_of(self, index: int) -> tuple[list[int], list | None]:
        return self._prompts.get(index // self.n, ([], None))

    def _prompt_extra(self, index: int) -> dict[str, Any]:
        """The choice's vLLM ``prompt_logprobs`` field, when asked for."""
        if self.prompt_logprobs is None:
            return {}
        ids, entries = self._prompt_of(index)
        return {"prompt_logprobs": None if entries is None
                else self.prompt_logprobs.prompt_by_id(ids, entries)}

    def _echoed(self, index: int, text: str) -> str:
        return text if self.echo is None else self.echo[index // self.n] + text

    @property
    def object_name(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_object_name(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _envelope(self, obj: str, choices: list[dict], **extra: Any) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created,
                "model": self.model, "choices": choices, **extra}

    def _logprobs(self, index: int, comp: Any, start: int,
                  text_offset: int) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        if self.chat:
            return self.logprobs.chat(comp, start)
        if self.echo is None:
            return self.logprobs.completion(comp, start, text_offset)
        # Offsets count the echoed prompt's characters too.
        result = self.logprobs.completion(comp, start, text_offset + len(self.echo[index // self.n]))
        ids, entries = self._prompt_of(index)
        if result is None or start or entries is None:
            return result
        head = self.logprobs.prompt_completion(ids, entries)
        return {key: head[key] + result[key] for key in result}

    def role_chunk(self, index: int, *, usage_field: bool) -> dict[str, Any]:
        """The chunk that opens a chat choice (OpenAI sends the role first, with no text)."""
        choice = {"index": index, "delta": {"role": "assistant", "content": ""},
                  "logprobs": None, "finish_reason": None}
        return self._envelope(self.chunk_object_name, [choice],
                              **({"usage": None} if usage_field else {}))

    def text_end(self, comp: Any) -> int:
        """How much of ``comp.text`` the chunks have carried once :meth:`chunk` sent it: all
        of it, less what may be a tool call while the choice runs."""
        if self.tools is None or comp.finish_reason is not None:
            return len(comp.text)
        return self.tools.content_end(comp.text)

    def _tool_calls(self, comp: Any) -> tuple[str | None, list[dict[str, Any]], str | None]:
        """``(content, tool_calls entries, finish_reason)`` of a finished chat choice."""
        content, calls = self.tools.extract(comp.text, comp.finish_reason)
        if not calls:
            return comp.text, [], comp.finish_reason
        reason = "tool_calls" if comp.finish_reason == "stop" else comp.finish_reason
        return content, [c.to_openai() for c in calls], reason

    def chunk(self, index: int, comp: Any, *, text_start: int, token_start: int,
              usage_field: bool) -> dict[str, Any]:
        """The chunk for what ``comp`` gained since ``text_start`` / ``token_start``."""
        delta = comp.text[text_start:self.text_end(comp)]
        if token_start == 0:   # the choice's first chunk
            delta = self._echoed(index, delta)
        logprobs = self._logprobs(index, comp, token_start, text_start)
        if self.chat:
            message: dict[str, Any] = {"content": delta}
            reason = comp.finish_reason
            if self.tools is not None and reason is not None:
                _, calls, reason = self._tool_calls(comp)
                if calls:   # the content before the calls, then the calls whole
                    content_end = max(text_start, self.tools.content_end(comp.text))
                    message = {"content": comp.text[text_start:content_end] or None}
                    message["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
            choice = {"index": index, "delta": message, "logprobs": logprobs,
                      "finish_reason": reason, "stop_reason": comp.stop_reason}
        else:
            choice = {"index": index, "text": delta, "logprobs": logprobs,
                      "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason,
                      **(self._prompt_extra(index) if token_start == 0 else {})}
        return self._envelope(self.chunk_object_name, [choice],
                              **({"usage": None} if usage_field else {}))

    def usage_chunk(self, usage_: dict[str, int]) -> dict[str, Any]:
        """The last chunk when the client asked for ``stream_options.include_usage``."""
        return self._envelope(self.chunk_object_name, [], usage=usage_)

    def response(self, choices: list[tuple[int, Any]], usage_: dict[str, int]) -> dict[str, Any]:
        """The whole (non-streamed) response.

        Args:
            choices: (OpenAI choice index, the engine's finished CompletionOutput), in order.
        """
        out = []
        for index, comp in choices:
            logprobs = self._logprobs(index, comp, 0, 0)
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": comp.text}
                reason = comp.finish_reason
                if self.tools is not None:
                    content, calls, reason = self._tool_calls(comp)
                    message["content"] = content
                    if calls:
                        message["tool_calls"] = calls
                out.append({"index": index, "message": message, "logprobs": logprobs,
                            "finish_reason": reason, "stop_reason": comp.stop_reason})
            else:
                out.append({"index": index, "text": self._echoed(index, comp.text),
                            "logprobs": logprobs, "finish_reason": comp.finish_reason,
                            "stop_reason": comp.stop_reason, **self._prompt_extra(index)})
        return self._envelope(self.object_name, out, usage=usage_)
