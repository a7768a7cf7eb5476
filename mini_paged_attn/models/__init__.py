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

from ..lazy_exports import lazy_exports

_EXPORTS = {"AttentionMetadata": ".attention", "ModelConfig": ".config", "RopeConfig": ".config",
            "resolve_dtype": ".config", "CausalLM": ".llama", "init_empty_model": ".registry",
            "load_model": ".loader", "tiny_llama": ".tiny", "write_tiny_llama": ".tiny",
            "IncrementalDetokenizer": ".tokenizer", "Tokenizer": ".tokenizer",
            "load_tokenizer": ".tokenizer"}
# Imported on first use: ``models.load_progress`` and the config readers need no torch.
__getattr__ = lazy_exports(__name__, globals(), _EXPORTS)

__all__ = sorted(_EXPORTS)
