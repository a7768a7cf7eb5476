"""mini_paged_attn: PagedAttention in Python, from the block manager to an OpenAI-compatible
server.

The root re-exports the block manager, the KV cache and the attention ops, and (imported on
first use) the engine's ``LLM``, ``LLMEngine`` and ``SamplingParams``. The layers, every
package and what each file owns: docs/architecture.md.
"""

import logging
import sys

from .errors import BlockStateError, OutOfBlocksError
from .core.block_manager import BlockManager
from .cache.manager import PagedAttentionManager
from .ops import (explain_decode, flash_attn_varlen_func, merge_attention_states,
                  num_splits_heuristic, paged_decode, paged_prefill, store_kv)

__version__ = "0.1.0"

# Registering with transformers imports transformers.modeling_utils (seconds); do it here only when
# the caller already uses transformers, else on mini_paged_attn.integrations.transformers.register().
if "transformers" in sys.modules:
    try:
        from .integrations import transformers as _hf_integration  # noqa: F401  (registers)
    except ImportError as exc:     # an older transformers: the rest of the library still works
        logging.getLogger(__name__).warning("attn_implementation='mini_paged_attn' not "
                                            "registered: %s", exc)

_ENGINE_NAMES = {"LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "LLMEngine",
                 "EngineStats", "TextPrompt", "TokensPrompt", "PromptType"}


def __getattr__(name: str):
    # The engine pulls in tokenizers and safetensors; import it only when asked for.
    if name in _ENGINE_NAMES:
        from . import engine
        return getattr(engine, name)
    raise AttributeError(f"module 'mini_paged_attn' has no attribute {name!r}")


__all__ = ["BlockManager", "PagedAttentionManager", "OutOfBlocksError", "BlockStateError",
           "paged_decode", "paged_prefill", "store_kv", "flash_attn_varlen_func",
           "merge_attention_states", "num_splits_heuristic", "explain_decode",
           *sorted(_ENGINE_NAMES)]
