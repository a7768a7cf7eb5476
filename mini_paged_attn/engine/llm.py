"""LLM: offline generation, shaped like vLLM's ``LLM`` (generate, chat, streaming)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .config import EngineConfig
from .llm_engine import LLMEngine
from .outputs import EngineStats, RequestOutput
from .sampling_params import SamplingParams

Prompt = str | list[int]
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
        **engine_options: other EngineConfig fields (backend, cpu_kv_cache_bytes, ...).
    """

    def __init__(self, model: str | Path, *, dtype: str = "auto", device: str | None = None,
                 block_size: int = 16, num_kv_blocks: int | None = None,
                 gpu_memory_utilization: float = 0.9, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, enforce_eager: bool = False, seed: int = 0,
                 kv_cache_dtype: str = "auto", tensor_parallel_size: int = 1,
                 **engine_options: Any) -> None:
        config = EngineConfig(
            block_size=block_size, num_kv_blocks=num_kv_blocks,
            gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching, enforce_eager=enforce_eager, seed=seed,
            kv_cache_dtype=kv_cache_dtype, tensor_parallel_size=tensor_parallel_size,
            **engine_options)
        self.engine = LLMEngine.from_model(model, dtype=dtype, device=device, config=config)

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an engine built from an in-memory model (``LLMEngine(model, tokenizer, ...)``)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        return llm

    def shutdown(self) -> None:
        """Stop the engine's other tensor-parallel processes (if any); idempotent. Also done
        when the LLM is garbage collected and at interpreter exit."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def stats(self) -> EngineStats:
        return self.engine.stats()

    # ---- batch generation ---------------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists); outputs in prompt order.

        ``sampling_params``: one for all prompts, or one per prompt. Every request is validated
        before any is queued (ValueError names the problem and the prompt's index).
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"sampling_params: expected one per prompt ({len(prompts)}), "
                                 f"got {len(sampling_params)}")
            params_list = list(sampling_params)
        else:
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        return self._run(prompts, params_list, use_tqdm)

    def chat(self, messages: Messages | Sequence[Messages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool = True, **chat_template_kwargs: Any) -> list[RequestOutput]:
        """Generate replies to one conversation or several, through the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self._chat_prompt(c, chat_template_kwargs) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _chat_prompt(self, messages: Messages, kwargs: dict) -> list[int]:
        return self.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                         **kwargs)

    def _run(self, prompts: list[Prompt], params_list: list[SamplingParams],
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
    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of one request (n must be 1) as it is produced, delta by delta.

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


def _progress(total: int, use_tqdm: bool):
    if not use_tqdm:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="generating", unit="req", dynamic_ncols=True)


__all__ = ["LLM"]
