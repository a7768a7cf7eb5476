"""ModelConfig: the decoder's shape and flags, read from a Hugging Face config.json.

Every family (``models/families/``, listed in ``registry.py``) shares one config. What differs
between them is a handful of flags and fields (qkv bias, q/k RMSNorm, tied embeddings, rope
scaling, partial rotary, sliding-window layers, logit soft-caps, experts), each family declaring
its rules in its :class:`~.family.Family`. What a config.json leaves out takes the default its
family declares, that of the family's transformers config class
(``config_families.config_fields``; transformers is not imported). A config.json without
``architectures`` (as converters write it) is recognized by its ``model_type``.

Sliding windows follow Hugging Face's meaning: a query at position ``p`` of a
``sliding_window`` layer sees the keys at ``p - sliding_window + 1 .. p`` (``sliding_window``
keys, itself included), i.e. the attention ops' ``window_size=(sliding_window - 1, 0)``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.args import positive_int
from ..errors import ModelLoadError
from .config_families import (ACTIVATIONS, LAYER_TYPES, activation, attention_pattern,
                              config_fields, parse_ropes)
from .family import Family
from .moe_config import MoeConfig
from .rope import ROPE_TYPES, RopeConfig

_DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16,
           "half": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ModelConfig:
    """Everything the decoder needs, under the library's names (num_q_heads, head_size, ...).

    ``dtype`` is the checkpoint's dtype (what "auto" resolves to). ``eos_token_ids`` merges
    config.json's and generation_config.json's ``eos_token_id`` (Qwen instruct models stop on
    both ``<|im_end|>`` and ``<|endoftext|>``).

    Attention pattern: ``layer_types[i]`` is "full_attention" or "sliding_attention" (left empty,
    every layer is sliding when ``sliding_window`` is set, else full); a sliding layer's queries
    see their last ``sliding_window`` keys, themselves included, and rotate with
    ``sliding_rope`` when set (Gemma 3's local base), else with ``rope``.
    """
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qkv_bias: bool = False        # bias on q/k/v projections (Qwen2 always; attention_bias)
    o_bias: bool = False          # bias on the output projection (Llama/Qwen3 attention_bias)
    mlp_bias: bool = False        # bias on gate/up/down (Llama mlp_bias)
    qk_norm: bool = False         # per-head RMSNorm on q and k before rope (Qwen3, Gemma 3)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    dtype: torch.dtype = torch.float32
    hidden_act: str = "silu"      # the gated MLP's activation: "silu" | "gelu_pytorch_tanh"
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    sliding_rope: RopeConfig | None = None
    query_pre_attn_scalar: float | None = None   # attention scale 1/sqrt(it) (Gemma), not head_size
    attn_logit_softcap: float = 0.0   # scores -> cap * tanh(scores / cap) before softmax (0: off)
    final_logit_softcap: float = 0.0  # logits -> cap * tanh(logits / cap) (0: off)
    moe: MoeConfig | None = None  # the sparse feed-forward of an MoE family, None when dense

    def __post_init__(self):
        _registry().by_architecture(self.architecture)     # ValueError naming the known ones
        for name in ("num_layers", "hidden_size", "intermediate_size", "num_q_heads",
                     "num_kv_heads", "head_size", "vocab_size", "max_position_embeddings"):
            object.__setattr__(self, name, positive_int(name, getattr(self, name)))
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: expected a divisor of num_q_heads={self.num_q_heads}, "
                             f"got {self.num_kv_heads}")
        if self.head_size % 2:
            raise ValueError(f"head_size: expected an even number (rotary pairs), got {self.head_size}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps: expected > 0, got {self.rms_norm_eps!r}")
        if self.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype: expected float32, float16 or bfloat16, got {self.dtype}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act: expected one of {ACTIVATIONS}, got {self.hidden_act!r}")
        for rope in (self.rope, self.sliding_rope):
            if rope is not None:
                rope.check_head_size(self.head_size)
        self._check_attention_pattern()
        for name in ("attn_logit_softcap", "final_logit_softcap"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: expected >= 0 (0: off), got {getattr(self, name)!r}")
        if self.query_pre_attn_scalar is not None and not self.query_pre_attn_scalar > 0:
            raise ValueError(f"query_pre_attn_scalar: expected > 0, got {self.query_pre_attn_scalar!r}")

    def _check_attention_pattern(self) -> None:
        window = self.sliding_window
        if window is not None:
            window = positive_int("sliding_window", window)
            object.__setattr__(self, "sliding_window", window)
        types = tuple(self.layer_types) or (
            ("sliding_attention" if window else "full_attention"),) * self.num_layers
        if len(types) != self.num_layers or any(t not in LAYER_TYPES for t in types):
            raise ValueError(f"layer_types: expected {self.num_layers} entries (num_layers), each "
                             f"one of {LAYER_TYPES}, got {list(self.layer_types)}")
        if window is None and "sliding_attention" in types:
            raise ValueError("sliding_window: expected a window size for the sliding_attention "
                             "layers of layer_types, got None")
        object.__setattr__(self, "layer_types", types)

    @property
    def family_spec(self) -> Family:
        """The :class:`~.family.Family` of ``architecture`` (its rules, its model class)."""
        return _registry().by_architecture(self.architecture)

    @property
    def family(self) -> str:
        """The family's name: "llama", "qwen3", "gemma3", "gpt_oss", ... (``registry.py``)."""
        return self.family_spec.name

    @property
    def q_size(self) -> int:
        return self.num_q_heads * self.head_size

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_size

    @property
    def attn_scale(self) -> float:
        """The factor on q.k: ``query_pre_attn_scalar ** -0.5`` when set, else ``head_size ** -0.5``."""
        return (self.query_pre_attn_scalar or self.head_size) ** -0.5

    @property
    def uniform_sliding_window(self) -> int | None:
        """``sliding_window`` when every layer is a sliding one (blocks wholly left of it can be
        freed), else None."""
        if all(t == "sliding_attention" for t in self.layer_types):
            return self.sliding_window
        return None

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (None: full attention)."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def layer_uses_sliding_rope(self, layer: int) -> bool:
        """Whether layer ``layer`` rotates with ``sliding_rope`` (a sliding layer, when the
        config has one) rather than ``rope``."""
        return self.sliding_rope is not None and self.layer_types[layer] == "sliding_attention"

    def layer_rope(self, layer: int) -> RopeConfig:
        """The rope parameters layer ``layer`` rotates with."""
        return self.sliding_rope if self.layer_uses_sliding_rope(layer) else self.rope

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, generation_config: dict[str, Any] | None = None,
                  source: str = "config.json") -> ModelConfig:
        """Parse a Hugging Face config dict; ``source`` names it in error messages.

        Absent fields take the family's defaults (those of its transformers config class),
        except the token ids: those come from the file (and ``generation_config``) alone, since
        a class's default ids belong to some other checkpoint's tokenizer
        (``config_families.config_fields``)."""
        spec = _registry().of_config(raw, source)
        fields = config_fields(spec, raw, source)

        def need(key: str):
            if fields.get(key) is None:
                raise ValueError(f"{source}: missing field {key!r} (needed for "
                                 f"{spec.architecture})")
            return fields[key]

        hidden_size = int(need("hidden_size"))
        num_q_heads = int(need("num_attention_heads"))
        num_kv_heads = int(fields.get("num_key_value_heads") or num_q_heads)
        # (config_fields refused a num_attention_heads below 1 by name)
        head_size = fields.get("head_dim") or hidden_size // num_q_heads
        num_layers = int(need("num_hidden_layers"))
        max_positions = int(need("max_position_embeddings"))
        attention_bias = bool(fields.get("attention_bias", False))
        always_qkv_bias = spec.qkv_bias == "always"
        eos = _merge_ids(fields.get("eos_token_id"),
                         (generation_config or {}).get("eos_token_id"))
        bos = fields.get("bos_token_id")
        window, layer_types = attention_pattern(fields, spec, num_layers, source)
        rope, sliding_rope = parse_ropes(fields, spec, max_positions, source)
        scalar = fields.get("query_pre_attn_scalar") if spec.query_pre_attn_scalar else None
        return cls(
            architecture=spec.architecture,
            num_layers=num_layers,
            hidden_size=hidden_size,
            intermediate_size=int(need("intermediate_size")),
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_size=int(head_size),
            vocab_size=int(need("vocab_size")),
            max_position_embeddings=max_positions,
            rms_norm_eps=float(need("rms_norm_eps")),
            rope=rope,
            tie_word_embeddings=bool(fields.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias or always_qkv_bias,
            o_bias=attention_bias and not always_qkv_bias,
            mlp_bias=bool(fields.get("mlp_bias", False)),
            qk_norm=spec.qk_norm,
            eos_token_ids=eos,
            bos_token_id=bos if isinstance(bos, int) else None,
            dtype=parse_dtype(fields.get("dtype") or "float32", f"{source}: dtype"),
            hidden_act=activation(fields, spec, source),
            sliding_window=window,
            layer_types=layer_types,
            sliding_rope=sliding_rope,
            query_pre_attn_scalar=float(scalar) if scalar else None,
            attn_logit_softcap=float(fields.get("attn_logit_softcapping") or 0.0),
            final_logit_softcap=float(fields.get("final_logit_softcapping") or 0.0),
            moe=spec.moe(fields, num_layers, source) if spec.moe else None,
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Read ``model_dir/config.json`` (and generation_config.json when present)."""
        model_dir = check_model_dir(model_dir)
        path = model_dir / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model_dir: no config.json in {str(model_dir)!r}")
        gen_path = model_dir / "generation_config.json"
        gen = read_json(gen_path) if gen_path.is_file() else None
        return cls.from_dict(read_json(path), generation_config=gen, source=str(path))


def check_model_dir(model_dir: str | Path) -> Path:
    """``model_dir`` as a Path, if it is a directory.

    Raises:
        FileNotFoundError: it is not; a name such as ``Qwen/Qwen2.5-0.5B-Instruct`` that looks
            like a Hugging Face hub id gets the command that makes a local copy of it.
    """
    path = Path(model_dir)
    if path.is_dir():
        if not any(path.iterdir()):
            raise FileNotFoundError(f"model_dir: {str(model_dir)!r} is empty (expected "
                                    "config.json, *.safetensors and tokenizer files)")
        return path
    text = str(model_dir)
    hint = ""
    if re.fullmatch(r"[\w.-]+/[\w.-]+", text) and not path.parent.exists():
        hint = (f"; it looks like a Hugging Face hub id, and models are read only from local "
                f"directories: download one with `hf download {text} "
                f"--local-dir {path.name}` and pass --model {path.name}")
    raise FileNotFoundError(f"model_dir: {text!r} is not a directory{hint}")


def read_json(path: Path) -> dict:
    """The JSON object in ``path``.

    Raises:
        ModelLoadError: the file is not valid JSON (names the file and where).
    """
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: expected JSON, got a file that does not parse "
                             f"({exc})") from exc


def parse_dtype(value: torch.dtype | str, what: str = "dtype") -> torch.dtype:
    """"bfloat16" / "torch.bfloat16" / torch.bfloat16 -> torch.bfloat16 (float32/16 likewise)."""
    if isinstance(value, torch.dtype):
        if value in _DTYPES.values():
            return value
    elif isinstance(value, str) and value.removeprefix("torch.") in _DTYPES:
        return _DTYPES[value.removeprefix("torch.")]
    raise ValueError(f"{what}: expected one of float32, float16, bfloat16, got {value!r}")


def resolve_dtype(dtype: torch.dtype | str | None, config: ModelConfig) -> torch.dtype:
    """The dtype to load in: ``None`` or "auto" means the checkpoint's (``config.dtype``)."""
    if dtype is None or dtype == "auto":
        return config.dtype
    return parse_dtype(dtype)


def _merge_ids(*values) -> tuple[int, ...]:
    out: list[int] = []
    for value in values:
        for i in ([value] if isinstance(value, int) else (value or [])):
            if isinstance(i, int) and i not in out:
                out.append(i)
    return tuple(out)


def _registry():
    # Imported when first needed: registry.py imports the family modules, which import the
    # model classes, which import this module. Read at call time, so a test can swap it.
    from . import registry
    return registry.REGISTRY


__all__ = ["ModelConfig", "RopeConfig", "ROPE_TYPES", "LAYER_TYPES", "check_model_dir",
           "parse_dtype", "read_json", "resolve_dtype"]
