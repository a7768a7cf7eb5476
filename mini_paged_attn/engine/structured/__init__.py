"""Structured outputs: grammar-constrained sampling (JSON schema, JSON object, regex, choice,
Lark/GBNF grammar) through llguidance, an optional dependency (``pip install -e ".[structured]"``).

``params``: :class:`StructuredOutputsParams`, what a request asks for; ``limits``:
:class:`GrammarLimits`, the bounds checked in Python before llguidance sees a constraint;
``grammar``: compiling it into a matcher (``contained``: on a big-stack thread, within a time
budget; ``cache``: templates kept by estimated bytes); ``manager``: a matcher per sample, the per-step bitmask and the
advance with each sampled token; ``bitmask``: applying the bitmask to the logits on the device.
"""

from .bitmask import TokenMasks, apply_token_masks, bitmask_words
from .grammar import INSTALL_HINT, GrammarCompiler, check_grammar
from .limits import DEFAULT_LIMITS, GrammarLimits, check_limits
from .manager import Advance, StructuredOutputs
from .params import StructuredOutputsParams

__all__ = ["Advance", "DEFAULT_LIMITS", "GrammarCompiler", "GrammarLimits", "INSTALL_HINT",
           "StructuredOutputs", "StructuredOutputsParams", "TokenMasks", "apply_token_masks",
           "bitmask_words", "check_grammar", "check_limits"]
