"""Structured outputs: grammar-constrained sampling (JSON schema, JSON object, regex, choice,
Lark/GBNF grammar) through llguidance, an optional dependency (``pip install -e ".[structured]"``).

``params``: :class:`StructuredOutputsParams`, what a request asks for; ``grammar``: compiling
it (cached) into a matcher; ``manager``: a matcher per sample, the per-step bitmask and the
advance with each sampled token; ``bitmask``: applying the bitmask to the logits on the device.
"""

from .bitmask import TokenMasks, apply_token_masks, bitmask_words
from .grammar import INSTALL_HINT, GrammarCompiler, check_grammar
from .manager import Advance, StructuredOutputs
from .params import StructuredOutputsParams

__all__ = ["Advance", "GrammarCompiler", "INSTALL_HINT", "StructuredOutputs",
           "StructuredOutputsParams", "TokenMasks", "apply_token_masks", "bitmask_words",
           "check_grammar"]
