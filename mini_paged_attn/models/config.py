"""ModelConfig: the decoder's shape and flags, read from a Hugging Face config.json.

One decoder implementation serves Llama 2/3.x, Qwen2/2.5 and Qwen3; what differs between them is
a handful of flags (qkv bias, q/k RMSNorm, tied embeddings, rope scaling) that this module reads
from config.json as transformers 4.4x through 5.x write it (``rope_theta`` + ``rope_scaling`` or
``rope_parameters``; ``torch_dtype`` or ``dtype``).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.args import positive_int
from ..errors import ModelLoadError
from .moe_config import MoeConfig, parse_moe_config

# architecture name in config.json -> the family whose flags apply
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    # mixture-of-experts families (models/moe_config.py)
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
ROPE_TYPES = ("default", "linear", "llama3")

_DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16,
           "half": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters.

    ``rope_type`` "default": inverse frequencies ``theta ** (-2i / head_size)``; "linear":
    divided by ``factor``; "llama3": Llama 3.1's banded rescaling (low frequencies divided by
    ``factor``, high ones kept, a smooth blend between) around
    ``original_max_position_embeddings``.
    """
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None

    def __post_init__(self):
        if not (self.theta > 0 and math.isfinite(self.theta)):
            raise ValueError(f"rope_theta: expected a finite number > 0, got {self.theta!r}")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope type: expected one of {ROPE_TYPES}, got {self.rope_type!r} "
                             "(this rope scaling is not supported)")
        if self.rope_type != "default" and not self.factor > 0:
            raise ValueError(f"rope factor: expected > 0, got {self.factor!r}")
        if self.rope_type == "llama3":
            if not self.original_max_position_embeddings:
                raise ValueError("rope original_max_position_embeddings: required by llama3 rope "
                                 f"scaling, got {self.original_max_position_embeddings!r}")
            if not self.high_freq_factor > self.low_freq_factor > 0:
                raise ValueError("rope high_freq_factor / low_freq_factor: expected "
                                 f"high > low > 0, got {self.high_freq_factor} / {self.low_freq_factor}")


@dataclass(frozen=True)
class ModelConfig:
    """Everything the decoder needs, under the library's names (num_q_heads, head_size, ...).

    ``dtype`` is the checkpoint's dtype (what "auto" resolves to). ``eos_token_ids`` merges
    config.json's and generation_config.json's ``eos_token_id`` (Qwen instruct models stop on
    both ``<|im_end|>`` and ``<|endoftext|>``).
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
    qk_norm: bool = False         # per-head RMSNorm on q and k before rope (Qwen3)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    dtype: torch.dtype = torch.float32
    moe: MoeConfig | None = None  # the sparse feed-forward of an MoE family, None when dense

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture: expected one of {sorted(SUPPORTED_ARCHITECTURES)}, "
                             f"got {self.architecture!r}")
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

    @property
    def family(self) -> str:
        """"llama" | "qwen2" | "qwen3" | "qwen3_moe" | "mixtral"."""
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def q_size(self) -> int:
        return self.num_q_heads * self.head_size

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_size

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, generation_config: dict[str, Any] | None = None,
                  source: str = "config.json") -> ModelConfig:
        """Parse a Hugging Face config dict; ``source`` names it in error messages."""
        architectures = raw.get("architectures") or []
        known = [a for a in architectures if a in SUPPORTED_ARCHITECTURES]
        if not known:
            raise ValueError(f"{source}: architectures {architectures!r} is not supported; "
                             f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        architecture = known[0]
        family = SUPPORTED_ARCHITECTURES[architecture]

        def need(key: str):
            if raw.get(key) is None:
                raise ValueError(f"{source}: missing field {key!r} (needed for {architecture})")
            return raw[key]

        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{source}: hidden_act {act!r} is not supported (expected 'silu')")
        if raw.get("use_sliding_window"):
            raise ValueError(f"{source}: use_sliding_window=true is not supported "
                             "(only full attention)")
        layer_types = raw.get("layer_types") or []
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(f"{source}: layer_types {sorted(set(layer_types))} are not supported "
                             "(only 'full_attention')")
        hidden_size = int(need("hidden_size"))
        num_q_heads = int(need("num_attention_heads"))
        num_kv_heads = int(raw.get("num_key_value_heads") or num_q_heads)
        # num_attention_heads 0 is refused (by name) in __post_init__, not as a ZeroDivisionError.
        head_size = raw.get("head_dim") or (hidden_size // num_q_heads if num_q_heads > 0 else 0)
        attention_bias = bool(raw.get("attention_bias", False))
        eos = _merge_ids(raw.get("eos_token_id"),
                         (generation_config or {}).get("eos_token_id"))
        return cls(
            architecture=architecture,
            num_layers=int(need("num_hidden_layers")),
            hidden_size=hidden_size,
            intermediate_size=int(need("intermediate_size")),
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_size=int(head_size),
            vocab_size=int(need("vocab_size")),
            max_position_embeddings=int(need("max_position_embeddings")),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=_parse_rope(raw, source),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias or family == "qwen2",
            o_bias=attention_bias and family != "qwen2",
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            eos_token_ids=eos,
            bos_token_id=raw.get("bos_token_id") if isinstance(raw.get("bos_token_id"), int) else None,
            dtype=parse_dtype(raw.get("dtype") or raw.get("torch_dtype") or "float32",
                              f"{source}: dtype"),
            moe=parse_moe_config(raw, family, int(need("num_hidden_layers")), source),
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
                f"directories: download one with `huggingface-cli download {text} "
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


def _parse_rope(raw: dict[str, Any], source: str) -> RopeConfig:
    # transformers 5 writes rope_parameters (theta inside); 4.x writes rope_theta + rope_scaling.
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{source}: rope type {rope_type!r} is not supported; supported: {ROPE_TYPES}")
    if merged.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{source}: partial_rotary_factor {merged['partial_rotary_factor']} is not "
                         "supported (rotary on the whole head only)")
    return RopeConfig(
        theta=float(theta), rope_type=rope_type, factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=merged.get("original_max_position_embeddings"))
