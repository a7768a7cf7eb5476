"""Structured outputs: grammar-constrained sampling (JSON schema, JSON object, regex, choice,
Lark/GBNF grammar) through llguidance, an optional dependency (``pip install -e ".[structured]"``).
The files: docs/architecture.md, ``engine/structured/``.
"""

from .bitmask import TokenMasks, apply_token_masks, bitmask_words
from .grammar import INSTALL_HINT, GrammarCompiler, check_grammar
from .limits import DEFAULT_LIMITS, GrammarLimits, check_limits
from .manager import Advance, StructuredOutputs
from .params import StructuredOutputsParams

__all__ = ["Advance", "DEFAULT_LIMITS", "GrammarCompiler", "GrammarLimits", "INSTALL_HINT",
           "StructuredOutputs", "StructuredOutputsParams", "TokenMasks", "apply_token_masks",
           "bitmask_words", "check_grammar", "check_limits"]
