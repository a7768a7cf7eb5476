"""Rotary position embedding parameters: the rope types, their config.json parsing, and the
inverse frequency of every rotary pair.

Types (``rope_type`` in config.json, or the older ``type``):

- "default": ``theta ** (-2i / head_size)`` for pair ``i``.
- "linear": default divided by ``factor``.
- "llama3": Llama 3.1's banded rescaling around ``original_max_position_embeddings``.
- "dynamic": NTK-aware scaling whose base grows with the sequence only *past*
  ``max_position_embeddings``; the rope table stops at ``max_position_embeddings`` rows, so
  inside it the frequencies are the default ones (what transformers computes there too).
- "yarn": per-pair blend of interpolated and original frequencies (ramp between the pairs
  turning ``beta_slow`` and ``beta_fast`` times over the original context), and cos/sin scaled
  by ``attention_factor`` (0.1 ln(factor) + 1 unless given).
- "longrope" (Phi-3): per-pair divisors ``short_factor`` for positions below
  ``original_max_position_embeddings`` and ``long_factor`` from there on, cos/sin scaled by
  ``attention_factor``. transformers switches the whole sequence to the long factors once it
  grows past the original context; a table indexed by position cannot, so a sequence crossing
  that boundary keeps the short factors on its early positions (as vLLM does).

Partial rotary (``partial_rotary_factor`` < 1, Phi-3 / Phi-4-mini): only the first
``rotary_dim = int(partial_rotary_factor * head_size)`` dims of each head rotate (as the pairs
``(i, i + rotary_dim / 2)``), the rest pass through unchanged; every type above then computes its
frequencies over ``rotary_dim`` instead of ``head_size``, as transformers does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")
_NEEDS_FACTOR = ("linear", "llama3", "dynamic", "yarn")
_NEEDS_ORIGINAL = ("llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters of one layer (see the module docstring for each type).

    ``attention_factor`` scales cos and sin (yarn, longrope; 1.0 for the others);
    ``short_factor`` / ``long_factor`` are longrope's per-pair divisors (``rotary_dim // 2``
    each); ``partial_rotary_factor`` in (0, 1]: the share of each head that rotates
    (:meth:`rotary_dim`).
    """
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    partial_rotary_factor: float = 1.0

    def __post_init__(self):
        if not (self.theta > 0 and math.isfinite(self.theta)):
            raise ValueError(f"rope_theta: expected a finite number > 0, got {self.theta!r}")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope type: expected one of {ROPE_TYPES}, got {self.rope_type!r} "
                             "(this rope scaling is not supported)")
        if self.rope_type in _NEEDS_FACTOR and not self.factor > 0:
            raise ValueError(f"rope factor: expected > 0, got {self.factor!r}")
        if self.rope_type in _NEEDS_ORIGINAL and not self.original_max_position_embeddings:
            raise ValueError(f"rope original_max_position_embeddings: required by {self.rope_type} "
                             f"rope scaling, got {self.original_max_position_embeddings!r}")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            raise ValueError("rope high_freq_factor / low_freq_factor: expected high > low > 0, "
                             f"got {self.high_freq_factor} / {self.low_freq_factor}")
        if self.rope_type == "longrope" and not (self.short_factor and self.long_factor):
            raise ValueError("rope short_factor / long_factor: required by longrope, got "
                             f"{len(self.short_factor)} / {len(self.long_factor)} values")
        if not self.attention_factor > 0:
            raise ValueError(f"rope attention_factor: expected > 0, got {self.attention_factor!r}")
        if not 0 < self.partial_rotary_factor <= 1:
            raise ValueError("rope partial_rotary_factor: expected a number in (0, 1], got "
                             f"{self.partial_rotary_factor!r}")

    def rotary_dim(self, head_size: int) -> int:
        """How many leading dims of a ``head_size`` head rotate: ``int(partial_rotary_factor *
        head_size)``, transformers' rounding (the rest pass through)."""
        return int(head_size * self.partial_rotary_factor)

    def check_head_size(self, head_size: int) -> None:
        """Raise ValueError if the rotated dims of a ``head_size`` head are not an even number
        >= 2, or longrope's per-pair factors do not fit them."""
        rotary_dim = self.rotary_dim(head_size)
        if rotary_dim < 2 or rotary_dim % 2:
            raise ValueError(f"rope partial_rotary_factor: {self.partial_rotary_factor} of "
                             f"head_size {head_size} rotates {rotary_dim} dims, expected an even "
                             "number >= 2 (rotary pairs)")
        for name in ("short_factor", "long_factor"):
            got = len(getattr(self, name))
            if got and got != rotary_dim // 2:
                raise ValueError(f"rope {name}: expected {rotary_dim // 2} values (one per "
                                 f"rotary pair: rotary_dim {rotary_dim} / 2), got {got}")


def parse_rope(params: dict[str, Any], *, default_theta: float, max_position_embeddings: int,
               original_max_position_embeddings: int | None = None,
               default_partial_rotary_factor: Any = None,
               source: str = "config.json") -> RopeConfig:
    """One layer's rope parameters (a ``rope_parameters`` / ``rope_scaling`` dict, theta inside or
    given as ``default_theta``) -> :class:`RopeConfig`, with transformers' defaults filled in.

    ``original_max_position_embeddings`` from outside the dict (Phi-3 writes it at the top of
    config.json) wins over the dict's, as in transformers; ``default_partial_rotary_factor``
    (the top-level field of older files) applies when the dict has none.

    Raises:
        ValueError: an unsupported rope type or a bad partial rotary factor (names ``source``).
    """
    theta = params.get("rope_theta", default_theta)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "su":                     # early Phi-3 spelling
        rope_type = "longrope"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{source}: rope type {rope_type!r} is not supported; "
                         f"supported: {ROPE_TYPES}")
    partial = params.get("partial_rotary_factor")
    partial = default_partial_rotary_factor if partial is None else partial
    partial = 1.0 if partial is None else partial
    if isinstance(partial, bool) or not isinstance(partial, (int, float)):
        raise ValueError(f"{source}: partial_rotary_factor: expected a number in (0, 1], got "
                         f"{partial!r}")
    original = (original_max_position_embeddings or params.get("original_max_position_embeddings")
                or (max_position_embeddings if rope_type in _NEEDS_ORIGINAL else None))
    factor = params.get("factor")
    if factor is None and rope_type in ("yarn", "longrope") and original:
        factor = max_position_embeddings / original
    factor = 1.0 if factor is None else float(factor)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = _default_attention_factor(rope_type, factor, params, original)
    return RopeConfig(
        theta=float(theta), rope_type=rope_type, factor=factor,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original) if original else None,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=float(attention_factor),
        short_factor=tuple(float(x) for x in params.get("short_factor") or ()),
        long_factor=tuple(float(x) for x in params.get("long_factor") or ()),
        partial_rotary_factor=float(partial))


def _default_attention_factor(rope_type: str, factor: float, params: dict[str, Any],
                              original: int | None) -> float:
    if rope_type == "yarn":
        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        return mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    if rope_type == "longrope" and factor > 1.0:
        return math.sqrt(1 + math.log(factor) / math.log(original))
    return 1.0


def rope_inv_freq(dim: int, rope: RopeConfig, device: torch.device | str | None = None,
                  *, long: bool = False) -> torch.Tensor:
    """Inverse frequency of each rotary pair: float32 ``[dim // 2]``.

    ``dim``: the rotated dims, ``rope.rotary_dim(head_size)`` (the head size unless the rotary
    is partial): every type computes its frequencies over them. ``long``: longrope's
    frequencies past the original context (``long_factor``); ignored by the other types.
    """
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    base = rope.theta ** exponents
    if rope.rope_type == "longrope":
        factors = rope.long_factor if long else rope.short_factor
        return 1.0 / (torch.tensor(factors, dtype=torch.float32, device=device) * base)
    inv_freq = 1.0 / base
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        # How many turns each pair makes over the original context decides its treatment:
        # pairs turning often (>= high_freq_factor) carry local order and stay as they are;
        # pairs turning rarely (<= low_freq_factor) are stretched by `factor` to reach the longer
        # context; in between, a linear blend in the number of turns.
        turns = rope.original_max_position_embeddings * inv_freq / (2 * math.pi)
        blend = ((turns - rope.low_freq_factor)
                 / (rope.high_freq_factor - rope.low_freq_factor)).clamp(0.0, 1.0)
        inv_freq = (1 - blend) * inv_freq / rope.factor + blend * inv_freq
    elif rope.rope_type == "yarn":
        inv_freq = _yarn_inv_freq(dim, rope, base)
    return inv_freq


def _yarn_inv_freq(dim: int, rope: RopeConfig, base: torch.Tensor) -> torch.Tensor:
    # The pair index at which a pair makes `turns` rotations over the original context.
    def pair_at(turns: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (turns * 2 * math.pi))
                / (2 * math.log(rope.theta)))

    low, high = pair_at(rope.beta_fast), pair_at(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001                          # a step instead of a ramp, without dividing by 0
    pairs = torch.arange(dim // 2, dtype=torch.float32, device=base.device)
    # 1 for fast pairs (kept as they are), 0 for slow ones (interpolated by `factor`).
    keep = 1 - ((pairs - low) / (high - low)).clamp(0, 1)
    return (1.0 / (rope.factor * base)) * (1 - keep) + (1.0 / base) * keep


def rope_table(head_size: int, max_positions: int, rope: RopeConfig, *, dtype: torch.dtype,
               device: torch.device | str | None = None) -> torch.Tensor:
    """The cos/sin table of positions ``0 .. max_positions``: ``[max_positions, rotary_dim]`` in
    ``dtype`` (``rotary_dim = rope.rotary_dim(head_size)``, ``head_size`` unless the rotary is
    partial), the cosines of the ``rotary_dim // 2`` pair angles then their sines, both scaled
    by ``attention_factor``; computed in float32 then cast (as transformers does)."""
    rotary_dim = rope.rotary_dim(head_size)
    positions = torch.arange(max_positions, dtype=torch.float32, device=device)
    angles = torch.outer(positions, rope_inv_freq(rotary_dim, rope, device))
    if rope.rope_type == "longrope" and max_positions > rope.original_max_position_embeddings:
        start = rope.original_max_position_embeddings
        angles[start:] = torch.outer(positions[start:],
                                     rope_inv_freq(rotary_dim, rope, device, long=True))
    table = torch.cat([angles.cos(), angles.sin()], dim=-1)
    if rope.attention_factor != 1.0:
        table = table * rope.attention_factor
    return table.to(dtype)


__all__ = ["ROPE_TYPES", "RopeConfig", "parse_rope", "rope_inv_freq", "rope_table"]
