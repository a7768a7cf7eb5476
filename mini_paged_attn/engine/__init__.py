"""The inference engine: ``LLM`` (offline, vLLM-shaped) over ``LLMEngine`` (thread-safe
submission, one step at a time), and the ``EngineClient``s a frontend holds
(``InprocEngineClient``, ``MPEngineClient``). Its subpackages and files, and one request's path
through them: docs/architecture.md, ``engine/``.
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
