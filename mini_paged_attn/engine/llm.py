"""LLM: offline generation, shaped like vLLM's ``LLM`` (generate, chat, streaming)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ..models.load_progress import LoadTimer, ProgressCallback
from .config import EngineConfig
from .llm_engine import LLMEngine
from .outputs import EngineStats, RequestOutput
from .prompts import PromptType, parse_prompts
from .sampling_params import SamplingParams
from .tools.choice import tool_constraint
from .tools.parsers import PARSERS, ToolCallMode, parser_for_template

logger = logging.getLogger(__name__)

Messages = list[dict[str, Any]]


class LLM:
    """Generate with a local Hugging Face model directory (or ``"tiny"``, the embedded random
    tiny Llama) through the paged-KV engine.

    Args:
        model: a model directory (config.json, *.safetensors, tokenizer files), a ``.gguf``
            file (needs the ``real`` extra; see models/gguf.py), ``"smollm2-135m"`` (a real
            GGUF model fetched once, see models/packaged.py) or ``"tiny"``.
        dtype: "auto" (the checkpoint's), "float32", "float16" or "bfloat16".
        device: "cuda", "cpu", ...; None picks CUDA when available.
        block_size, num_kv_blocks, gpu_memory_utilization, max_num_seqs,
        max_num_batched_tokens, max_model_len, enable_prefix_caching, enforce_eager, seed,
        kv_cache_dtype, tensor_parallel_size: see :class:`~.config.EngineConfig`
            (``kv_cache_dtype="fp8"``: an e4m3 KV cache, twice the tokens in the same memory;
            ``tensor_parallel_size=N``: the model split over N processes, one GPU each on
            CUDA; :meth:`shutdown` stops them).
        tokenizer: a local model directory whose tokenizer is used instead of the model's
            (vLLM's ``tokenizer``); its ids must be the model's vocabulary. None: the model's.
        load_progress: called with a :class:`~mini_paged_attn.models.load_progress.LoadEvent`
            as each phase of the load (config, tokenizer, weights, KV pool, CUDA graphs,
            warm-up) starts, advances and ends: what a progress bar needs
            (``commands/progress.py`` draws one). Whatever it is, the time each phase took
            is logged at INFO once the engine is built.
        **engine_options: other EngineConfig fields (backend, cpu_kv_cache_bytes, ...).
    """

    def __init__(self, model: str | Path, *, dtype: str = "auto", device: str | None = None,
                 block_size: int = 16, num_kv_blocks: int | None = None,
                 gpu_memory_utilization: float = 0.9, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, enforce_eager: bool = False, seed: int = 0,
                 kv_cache_dtype: str = "auto", tensor_parallel_size: int = 1,
                 tokenizer: str | Path | None = None,
                 load_progress: ProgressCallback | None = None,
                 **engine_options: Any) -> None:
        timer = LoadTimer(load_progress)
        config = EngineConfig(
            block_size=block_size, num_kv_blocks=num_kv_blocks,
            gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching, enforce_eager=enforce_eager, seed=seed,
            kv_cache_dtype=kv_cache_dtype, tensor_parallel_size=tensor_parallel_size,
            **engine_options)
        self.engine = LLMEngine.from_model(model, dtype=dtype, device=device, config=config,
                                           tokenizer=tokenizer, load_timer=timer)
        logger.info("%s %s", model, timer.summary())

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an engine built from an in-memory model (``LLMEngine(model, tokenizer, ...)``)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        return llm

    def shutdown(self) -> None:
        """Stop the engine's other tensor-parallel processes (if any) and give back its device
        memory (CUDA graphs, KV pool, workspaces, weights), even while this LLM is still
        referenced; it cannot generate after (RuntimeError). Idempotent. Without it, both
        happen when the LLM's last reference goes (``del llm``) and at interpreter exit."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    @property
    def tokenizer(self):
        """The engine's :class:`~mini_paged_attn.models.tokenizer.Tokenizer` (this project's
        wrapper: encode, decode, chat template, eos ids)."""
        return self.engine.tokenizer

    def get_tokenizer(self) -> Any:
        """The Hugging Face tokenizer (a ``transformers`` ``PreTrainedTokenizerBase``), as
        vLLM's ``LLM.get_tokenizer()`` returns it: ``encode``, ``decode``,
        ``apply_chat_template``, ``eos_token_id`` ... The engine's wrapper is
        :attr:`tokenizer`."""
        return self.engine.tokenizer.hf

    def stats(self) -> EngineStats:
        return self.engine.stats()

    # ---- batch generation ---------------------------------------------------------------------
    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; outputs in prompt order.

        ``prompts``: one prompt or a list of them, each a str, a list of int token ids,
        ``{"prompt": str}`` (:class:`~.prompts.TextPrompt`) or ``{"prompt_token_ids": [...]}``
        (:class:`~.prompts.TokensPrompt`), as in vLLM. ``sampling_params``: one for all
        prompts, or one per prompt. Every request is validated before any is queued.

        Raises:
            TypeError: a prompt of no known form (names ``prompts[i]``).
            ValueError: a bad request (names the problem and ``prompts[i]``).
        """
        prompts = parse_prompts(prompts)
        params_list = _params_per_prompt(sampling_params, len(prompts))
        return self._run(prompts, params_list, use_tqdm)

    def chat(self, messages: Messages | Sequence[Messages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool = True, tools: list[dict[str, Any]] | None = None,
             tool_choice: str | dict[str, Any] | None = None, parallel_tool_calls: bool = True,
             tool_call_parser: str | None = None,
             **chat_template_kwargs: Any) -> list[RequestOutput]:
        """Generate replies to one conversation or several, through the model's chat template.

        Args:
            tools: OpenAI-style function specs, ``[{"type": "function", "function": {"name",
                "description", "parameters"}}]``, rendered into the prompt by the template;
                each output's ``tool_calls`` then holds the calls read from its text (see
                :class:`~.outputs.CompletionOutput`).
            tool_choice: "auto" (the default with tools: the model may call), "none",
                "required" (the output is constrained to one or more valid calls) or
                ``{"type": "function", "function": {"name": ...}}`` (constrained to that
                function's arguments); see ``engine/tools/choice.py``. "required" and a named
                function need llguidance and no ``structured_outputs`` in sampling_params.
            parallel_tool_calls: False: "required" allows one call only.
            tool_call_parser: the call format "auto" reads ("hermes", "llama3_json"); None:
                the one the chat template shows.

        Raises:
            ValueError: naming the argument (``tools[i].function.name``, ``tool_choice``, ...),
                before any request is queued.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        params_list = _params_per_prompt(sampling_params, len(conversations))
        if tools is None and tool_choice is None:
            modes = [None] * len(params_list)
        else:
            params_list, modes = self._with_tools(params_list, tools, tool_choice,
                                                  parallel_tool_calls, tool_call_parser)
            chat_template_kwargs["tools"] = tools
        prompts = [self._chat_prompt(c, chat_template_kwargs) for c in conversations]
        outputs = self._run(prompts, params_list, use_tqdm)
        for output, mode in zip(outputs, modes):
            if mode is not None:
                for completion in output.outputs:
                    _, completion.tool_calls = mode.extract(completion.text,
                                                            completion.finish_reason)
        return outputs

    def _with_tools(self, params_list: list[SamplingParams], tools, tool_choice,
                    parallel_tool_calls: bool, parser: str | None
                    ) -> tuple[list[SamplingParams], list[ToolCallMode | None]]:
        """Each request's params with the constraint ``tool_choice`` asks for, and its mode."""
        if parser is None:
            parser = parser_for_template(
                getattr(getattr(self.engine.tokenizer, "hf", None), "chat_template", None))
        elif parser not in PARSERS:
            raise ValueError(f"tool_call_parser: expected one of {sorted(PARSERS)}, got "
                             f"{parser!r}")
        out_params, modes = [], []
        for params in params_list:
            constraint, mode = tool_constraint(
                tools, tool_choice, parser=parser, parallel_tool_calls=parallel_tool_calls,
                constrained_by=("sampling_params.structured_outputs"
                                if params.structured_outputs is not None else None),
                compiler=self.engine.structured.compiler)
            if constraint is not None:
                params = dataclasses.replace(params, structured_outputs=constraint)
            out_params.append(params)
            modes.append(mode)
        return out_params, modes

    def _chat_prompt(self, messages: Messages, kwargs: dict) -> list[int]:
        return self.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                         **kwargs)

    def _run(self, prompts: list[str | list[int]], params_list: list[SamplingParams],
             use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        ids: list[str] = []
        try:
            for prompt, params in zip(prompts, params_list):
                ids.append(engine.add_request(prompt, params, final_only=True))
        except ValueError as exc:
            for request_id in ids:
                engine.abort_request(request_id)
            self._drain(set(ids))
            raise ValueError(f"prompts[{len(ids)}]: {exc}") from exc
        wanted = set(ids)
        results: dict[str, RequestOutput] = {}
        bar = _progress(len(ids), use_tqdm)
        try:
            while len(results) < len(ids):
                if not engine.has_unfinished_requests():
                    raise RuntimeError("the engine has no unfinished requests, but "
                                       f"{len(ids) - len(results)} outputs are missing")
                for output in engine.step():
                    if output.finished and output.request_id in wanted:
                        results[output.request_id] = output
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for request_id in wanted - results.keys():
                engine.abort_request(request_id)
            self._drain(wanted - results.keys())
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]

    def _drain(self, request_ids: set[str]) -> None:
        """Step until the given (aborted) requests are gone, freeing their blocks."""
        while request_ids and self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    request_ids.discard(output.request_id)

    # ---- streaming ----------------------------------------------------------------------------
    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None
               ) -> Iterator[str]:
        """Yield the text of one request (n must be 1) as it is produced, delta by delta.
        ``prompt``: any one form :meth:`generate` takes (TypeError for another).

        Closing the generator early aborts the request.
        """
        params = sampling_params or SamplingParams()
        if params.n != 1:
            raise ValueError(f"sampling_params.n: expected 1 for streaming, got {params.n}")
        return self._stream(self.engine.add_request(prompt, params))

    def chat_stream(self, messages: Messages, sampling_params: SamplingParams | None = None,
                    **chat_template_kwargs: Any) -> Iterator[str]:
        """:meth:`stream` of the reply to one conversation."""
        return self.stream(self._chat_prompt(messages, chat_template_kwargs), sampling_params)

    def _stream(self, request_id: str) -> Iterator[str]:
        sent = 0
        finished = False
        try:
            while not finished:
                for output in self.engine.step():
                    if output.request_id != request_id:
                        continue
                    text = output.outputs[0].text
                    if len(text) > sent:
                        yield text[sent:]
                        sent = len(text)
                    finished = output.finished
        finally:
            if not finished:
                self.engine.abort_request(request_id)
                self._drain({request_id})


def _params_per_prompt(sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                       n: int) -> list[SamplingParams]:
    """One SamplingParams for each of ``n`` prompts (a single one is shared)."""
    if isinstance(sampling_params, (list, tuple)):
        if len(sampling_params) != n:
            raise ValueError(f"sampling_params: expected one per prompt ({n}), "
                             f"got {len(sampling_params)}")
        return list(sampling_params)
    return [sampling_params or SamplingParams()] * n


def _progress(total: int, use_tqdm: bool):
    if not use_tqdm:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="generating", unit="req", dynamic_ncols=True)


__all__ = ["LLM"]
