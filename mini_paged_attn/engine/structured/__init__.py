"""Structured outputs: grammar-constrained sampling (JSON schema, JSON object, regex, choice,
Lark/GBNF grammar) through llguidance, an optional dependency (``pip install -e ".[structured]"``).
The files: docs/architecture.md, ``engine/structured/``.
"""

from ...lazy_exports import lazy_exports

_EXPORTS = {"TokenMasks": ".bitmask", "apply_token_masks": ".bitmask", "bitmask_words": ".bitmask",
            "INSTALL_HINT": ".grammar", "GrammarCompiler": ".grammar", "check_grammar": ".grammar",
            "DEFAULT_LIMITS": ".limits", "GrammarLimits": ".limits", "check_limits": ".limits",
            "Advance": ".manager", "StructuredOutputs": ".manager",
            "StructuredOutputsParams": ".params"}
# Imported on first use: SamplingParams needs the params, not the masks' torch.
__getattr__ = lazy_exports(__name__, globals(), _EXPORTS)

__all__ = sorted(_EXPORTS)
