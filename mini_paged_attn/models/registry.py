"""The model families the library serves, and the empty model the loader fills.

A family is one module of ``models/families/`` (its :class:`~.family.Family` as ``FAMILY``);
this list is the only other place that names it. Every family's model is a
:class:`~.llama.CausalLM`: the shared decoder, Gemma's layers (``gemma.py``) or expert blocks
(``moe_decoder.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from typing import Any

import torch

from ..distributed.group import TPGroup
from . import families
from .config import ModelConfig
from .family import Family
from .llama import CausalLM


@dataclass(frozen=True)
class Registry:
    """The families one can load, looked up by name, architecture or model_type.

    Raises (at construction):
        ValueError: two families share a name, an architecture or a model_type, or a
            family's ``model_class`` is not a :class:`CausalLM`.
    """
    families: tuple[Family, ...]

    def __post_init__(self):
        for field in ("name", "architecture", "model_type"):
            values = [getattr(f, field) for f in self.families]
            repeated = sorted({v for v in values if values.count(v) > 1})
            if repeated:
                raise ValueError(f"families: expected each {field} once, got {repeated} twice")
        for family in self.families:
            if not (isinstance(family.model_class, type)
                    and issubclass(family.model_class, CausalLM)):
                raise ValueError(f"{family.name}: model_class: expected a CausalLM subclass, "
                                 f"got {family.model_class!r}")

    def with_family(self, family: Family) -> Registry:
        """This registry and ``family``."""
        return Registry(self.families + (family,))

    @property
    def architectures(self) -> list[str]:
        return sorted(f.architecture for f in self.families)

    @property
    def model_types(self) -> list[str]:
        return sorted(f.model_type for f in self.families)

    def by_name(self, name: str) -> Family:
        """The family called ``name`` (ModelConfig.family). Raises ValueError when unknown."""
        return self._find("name", name, "family")

    def by_architecture(self, architecture: str) -> Family:
        """The family of ``architecture``. Raises ValueError when unknown."""
        return self._find("architecture", architecture, "architecture")

    def _find(self, field: str, value: str, param: str) -> Family:
        for family in self.families:
            if getattr(family, field) == value:
                return family
        known = sorted(getattr(f, field) for f in self.families)
        raise ValueError(f"{param}: expected one of {known}, got {value!r}")

    def of_config(self, raw: dict[str, Any], source: str) -> Family:
        """The family of a config.json dict: its first known ``architectures`` entry, or, when
        it names none, its ``model_type`` (converters write no architectures).

        Raises:
            ValueError: neither is known (names what the file says and what is supported).
        """
        architectures = raw.get("architectures") or []
        for architecture in architectures:
            for family in self.families:
                if family.architecture == architecture:
                    return family
        model_type = raw.get("model_type")
        if architectures:
            raise ValueError(f"{source}: architectures {architectures!r} is not supported; "
                             f"supported: {self.architectures}")
        for family in self.families:
            if family.model_type == model_type:
                return family
        raise ValueError(f"{source}: no architectures and model_type {model_type!r} is not "
                         f"supported; expected architectures (one of {self.architectures}) or "
                         f"model_type (one of {self.model_types})")


# The modules of models/families/, one line per family.
FAMILY_MODULES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "gemma2",
    "gemma3",
    "qwen3_moe",
    "mixtral",
    "gpt_oss",
)
# ModelConfig reads this module's REGISTRY when it looks a family up.
REGISTRY = Registry(tuple(import_module(f"{families.__name__}.{name}").FAMILY
                          for name in FAMILY_MODULES))


def model_class(config: ModelConfig) -> type[CausalLM]:
    """The :class:`CausalLM` subclass of ``config``'s family."""
    return config.family_spec.model_class


def build_model(config: ModelConfig, *, dtype: torch.dtype | None = None,
                device: torch.device | str | None = None, tp: TPGroup | None = None) -> CausalLM:
    """``config``'s model with PyTorch's default init (tests; see :func:`init_empty_model`)."""
    return model_class(config)(config, dtype=dtype, device=device, tp=tp)


def init_empty_model(config: ModelConfig, *, dtype: torch.dtype, device: torch.device | str,
                     tp: TPGroup | None = None) -> CausalLM:
    """``config``'s model (``tp``'s shard of it) whose weights are allocated on ``device`` in
    ``dtype`` but not initialised (filled by the loader): built on the meta device, then
    materialised once. The vocabulary padding rows of the last rank are zeroed (no checkpoint
    tensor fills them)."""
    model = build_model(config, dtype=dtype, device="meta", tp=tp)
    model.to_empty(device=device)
    model.reset_rotary()
    valid = model.layout.vocab_valid
    with torch.no_grad():
        for table in (model.embed_tokens, model.lm_head):
            if table is not None:
                table.weight[valid:].zero_()
    return model


__all__ = ["FAMILY_MODULES", "REGISTRY", "Registry", "build_model", "init_empty_model", "model_class"]
