"""The inference engine: sampling parameters, outputs, the scheduler-driven LLMEngine and LLM.

``LLM`` (offline, vLLM-shaped) wraps ``LLMEngine`` (one step at a time, thread-safe submission),
which drives ``core.Scheduler`` and the ``ModelRunner`` (KV cache, metadata, CUDA graphs,
sampling on the device).
"""

from .config import EngineConfig
from .llm import LLM
from .llm_engine import LLMEngine
from .outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["CompletionOutput", "EngineConfig", "EngineStats", "LLM", "LLMEngine", "RequestMetrics",
           "RequestOutput", "SamplingParams"]
