"""The inference engine: ``LLM`` (offline, vLLM-shaped) over ``LLMEngine`` (thread-safe
submission, one step at a time), and the ``EngineClient``s a frontend holds
(``InprocEngineClient``, ``MPEngineClient``). Its subpackages and files, and one request's path
through them: docs/architecture.md, ``engine/``.
"""

from ..lazy_exports import lazy_exports

_EXPORTS = {
    "EngineConfig": ".config", "LLM": ".llm", "LLMEngine": ".llm_engine",
    "EngineClient": ".process.client", "EngineDeadError": ".process.client",
    "InprocEngineClient": ".process.client", "MPEngineClient": ".process.mp_client",
    **{name: ".outputs" for name in ("CompletionOutput", "EngineStats", "Logprob",
                                     "RequestMetrics", "RequestOutput")},
    "PromptType": ".prompts", "TextPrompt": ".prompts", "TokensPrompt": ".prompts",
    "SamplingParams": ".sampling_params", "StructuredOutputsParams": ".structured",
}
# Imported on first use: the engine's process boundary (its messages, outputs and sampling
# params) loads without torch, so a server can start its engine process first.
__getattr__ = lazy_exports(__name__, globals(), _EXPORTS)

__all__ = sorted(_EXPORTS)
