"""mini_paged_attn: PagedAttention in Python, from the block manager to an OpenAI-compatible
server.

The root re-exports the block manager, the KV cache, the attention ops and the engine's
``LLM``, ``LLMEngine`` and ``SamplingParams``, each imported on first use. The layers, every
package and what each file owns: docs/architecture.md.
"""

import logging
import sys

from .lazy_exports import lazy_exports

__version__ = "0.1.0"

# Imported on first use: the command line and the engine's process boundary import this
# package without paying for torch before they need it.
_EXPORTS = {
    "BlockStateError": ".errors", "OutOfBlocksError": ".errors",
    "BlockManager": ".core.block_manager", "PagedAttentionManager": ".cache.manager",
    **{name: ".ops" for name in ("cascade_attention", "explain_decode", "flash_attn_varlen_func",
                                 "flash_attn_func", "flash_attn_qkvpacked_func",
                                 "flash_attn_kvpacked_func",
                                 "flash_attn_varlen_qkvpacked_func",
                                 "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache",
                                 "merge_attention_states", "num_splits_heuristic",
                                 "paged_decode", "paged_prefill", "store_kv")},
    **{name: ".engine" for name in ("LLM", "SamplingParams", "RequestOutput",
                                    "CompletionOutput", "LLMEngine", "EngineStats",
                                    "TextPrompt", "TokensPrompt", "PromptType")},
}
__getattr__ = lazy_exports(__name__, globals(), _EXPORTS)

# Registering with transformers imports transformers.modeling_utils (seconds); do it here only when
# the caller already uses transformers, else on mini_paged_attn.integrations.transformers.register().
if "transformers" in sys.modules:
    try:
        from .integrations import transformers as _hf_integration  # noqa: F401  (registers)
    except ImportError as exc:     # an older transformers: the rest of the library still works
        logging.getLogger(__name__).warning("attn_implementation='mini_paged_attn' not "
                                            "registered: %s", exc)

__all__ = sorted(_EXPORTS)
