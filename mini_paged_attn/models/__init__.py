"""Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3, Phi-3, Gemma 2 and Gemma 3 (text), and the
mixture-of-experts Qwen3-MoE, Mixtral and gpt-oss (``moe_decoder.py``), over the paged KV
cache, read from local Hugging Face dirs.

- :func:`load_model` (``loader.py``): config.json + safetensors -> ``(CausalLM, ModelConfig)``.
- :class:`CausalLM` (``llama.py``; Gemma's in ``gemma.py``; which family uses which class:
  its module in ``families/``, listed in ``registry.py``):
  ``forward(input_ids, positions, kv_caches, meta)`` and ``compute_logits(hidden)``; :class:`AttentionMetadata` (``attention.py``) is one step's input.
- :func:`load_tokenizer` (``tokenizer.py``): :class:`Tokenizer`, :class:`IncrementalDetokenizer`.
- :func:`tiny_llama` / :func:`write_tiny_llama` (``tiny.py``): the embedded RANDOM tiny Llama.
"""

from .attention import AttentionMetadata
from .config import ModelConfig, RopeConfig, resolve_dtype
from .llama import CausalLM
from .registry import init_empty_model
from .loader import load_model
from .tiny import tiny_llama, write_tiny_llama
from .tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer

__all__ = ["AttentionMetadata", "CausalLM", "IncrementalDetokenizer", "ModelConfig", "RopeConfig",
           "Tokenizer", "init_empty_model", "load_model", "load_tokenizer", "resolve_dtype",
           "tiny_llama", "write_tiny_llama"]
