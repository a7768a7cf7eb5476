"""SpeculativeConfig: how the engine proposes tokens for the target model to verify (vLLM's
``speculative_config`` names), validated; no torch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ...core.args import positive_int

METHODS = ("ngram", "draft_model")
# Prompt lookup's match lengths when neither bound is given.
DEFAULT_PROMPT_LOOKUP_MIN = 2
DEFAULT_PROMPT_LOOKUP_MAX = 4
DISABLE_BY_BATCH_SIZE = 32
"""Running sequences above which a step does not speculate (``disable_by_batch_size``). A
batch that large is bound by compute rather than by reading the weights once per token: the
k + 1 query tokens of each sequence then cost close to k + 1 decode steps, and the rejected
ones are lost (vLLM turns speculation off by batch size for the same reason)."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding for an engine.

    Args:
        method: "ngram" (prompt lookup: the tokens that followed the latest earlier
            occurrence of the sequence's last n tokens, prompt and output alike) or
            "draft_model" (a smaller model of the same vocabulary proposes greedily).
        num_speculative_tokens: k, the tokens proposed per step and sequence (>= 1).
        prompt_lookup_min, prompt_lookup_max: "ngram" only, the match lengths n tried, the
            longest first (``1 <= min <= max``). One given: the other is the same; neither:
            2 and 4.
        model: "draft_model" only: the draft's model directory (or any model the loader
            reads: a .gguf file, a packaged name); its vocabulary must be the target's.
        disable_by_batch_size: a step with more running sequences than this does not
            speculate (see :data:`DISABLE_BY_BATCH_SIZE`, the default).

    Raises:
        ValueError: naming ``speculative_config.<field>``, what was expected and what came.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    disable_by_batch_size: int = DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        def field_error(name: str, expected: str) -> ValueError:
            return ValueError(f"speculative_config.{name}: expected {expected}, got "
                              f"{getattr(self, name)!r}")

        if self.method not in METHODS:
            raise field_error("method", f"one of {METHODS}")
        for name in ("num_speculative_tokens", "disable_by_batch_size"):
            object.__setattr__(self, name, positive_int(f"speculative_config.{name}",
                                                        getattr(self, name)))
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if self.method == "ngram":
            if self.model is not None:
                raise field_error("model", "None with method 'ngram' (a draft model is "
                                           "method 'draft_model')")
            if low is None and high is None:
                low, high = DEFAULT_PROMPT_LOOKUP_MIN, DEFAULT_PROMPT_LOOKUP_MAX
            low = high if low is None else low
            high = low if high is None else high
            for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
                object.__setattr__(self, name, positive_int(f"speculative_config.{name}",
                                                            value))
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise ValueError(f"speculative_config.prompt_lookup_min: expected <= "
                                 f"prompt_lookup_max ({self.prompt_lookup_max}), got "
                                 f"{self.prompt_lookup_min}")
        else:
            if not isinstance(self.model, (str, Path)) or not str(self.model):
                raise field_error("model", "the draft model's path or name with method "
                                           "'draft_model'")
            object.__setattr__(self, "model", str(self.model))
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, name) is not None:
                    raise field_error(name, "None with method 'draft_model' (prompt lookup "
                                            "is method 'ngram')")

    @classmethod
    def of(cls, value: object) -> SpeculativeConfig | None:
        """``value`` as a SpeculativeConfig: one already, a dict of its fields (what
        ``LLM(speculative_config={...})`` and ``serve --speculative-config '{...}'`` give),
        or None (no speculation).

        Raises:
            TypeError: neither a dict, a SpeculativeConfig nor None.
            ValueError: an unknown or missing field, or a bad value (naming it).
        """
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"speculative_config: expected a dict or a SpeculativeConfig, "
                            f"got {type(value).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(str(k) for k in value if k not in names)
        if unknown:
            raise ValueError(f"speculative_config: expected fields among {names}, got "
                             f"unknown {unknown}")
        for name in ("method", "num_speculative_tokens"):
            if name not in value:
                raise ValueError(f"speculative_config.{name}: expected a value, got none")
        return cls(**value)


__all__ = ["DISABLE_BY_BATCH_SIZE", "METHODS", "SpeculativeConfig"]
