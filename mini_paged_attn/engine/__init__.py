"""The inference engine: sampling parameters, outputs, the scheduler-driven LLMEngine and LLM.

``LLM`` (offline, vLLM-shaped) wraps ``LLMEngine`` (one step at a time, thread-safe submission),
which drives ``core.Scheduler`` and the ``ModelRunner`` (KV cache, metadata, CUDA graphs,
sampling on the device). ``EngineClient`` (``InprocEngineClient``: the engine's core on a
thread; ``MPEngineClient``: in a child process) is what frontends such as the server use: they
add and abort requests and receive outputs; the core steps the engine.
"""

from .config import EngineConfig
from .process.client import EngineClient, EngineDeadError, InprocEngineClient
from .llm import LLM
from .llm_engine import LLMEngine
from .process.mp_client import MPEngineClient
from .outputs import CompletionOutput, EngineStats, Logprob, RequestMetrics, RequestOutput
from .prompts import PromptType, TextPrompt, TokensPrompt
from .sampling_params import SamplingParams
from .structured import StructuredOutputsParams

__all__ = ["CompletionOutput", "EngineClient", "EngineConfig", "EngineDeadError", "EngineStats",
           "InprocEngineClient", "LLM", "LLMEngine", "Logprob", "MPEngineClient", "PromptType",
           "RequestMetrics",
           "RequestOutput", "SamplingParams", "StructuredOutputsParams", "TextPrompt",
           "TokensPrompt"]
