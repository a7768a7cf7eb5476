"""GGUF checkpoints (the files llama.cpp users hold), read through transformers' GGUF loader.

A ``.gguf`` file carries the model's config, its tokenizer (vocabulary, merges, chat template)
and its weights, often quantized (Q4_0, Q4_1, Q8_0, K-quants, ...). transformers parses the
metadata into a Hugging Face config and tokenizer, and dequantizes every tensor to float32 with
the ``gguf`` package while it renames it to its Hugging Face name; the engine then holds the
weights in the load dtype like any other checkpoint (the engine has no quantized matmuls: a
Q4 file takes its float size in memory once loaded).

Families: those the engine supports (Llama, Qwen2, Qwen3); another architecture is refused by
name. The ``gguf`` package is an optional extra: ``pip install -e ".[real]"``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from ..distributed.group import TPGroup
from ..errors import ModelLoadError
from .config import SUPPORTED_ARCHITECTURES, ModelConfig, resolve_dtype
from .llama import CausalLM
from .registry import init_empty_model
from .tokenizer import Tokenizer

logger = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"
GGUF_MAGIC = b"GGUF"
INSTALL_HINT = 'pip install -e ".[real]"'


def is_gguf_path(model: str | Path) -> bool:
    """Whether ``model`` names a GGUF file (by its ``.gguf`` suffix; it need not exist)."""
    return str(model).lower().endswith(GGUF_SUFFIX)


def gguf_missing() -> str | None:
    """Why GGUF files cannot be read here (the ``gguf`` package is absent), or None."""
    import importlib.util

    if importlib.util.find_spec("gguf") is None:
        return f"reading GGUF files needs the gguf package: {INSTALL_HINT}"
    return None


def check_gguf_file(path: str | Path) -> Path:
    """``path`` as a Path, if it is a readable GGUF file and ``gguf`` is installed.

    Raises:
        FileNotFoundError: no such file.
        ModelLoadError: not a GGUF file (its first bytes are not ``GGUF``), or the ``gguf``
            package is missing (the message gives the install command).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model: {str(path)!r} is not a file (expected a .gguf file)")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{path}: expected a GGUF file (starting with b'GGUF'), got one "
                             f"starting with {magic!r}; it may be truncated")
    problem = gguf_missing()
    if problem is not None:
        raise ModelLoadError(problem)
    return path


def _hf_config(path: Path) -> Any:
    """transformers' config of the GGUF file (parsed from its metadata)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, KeyError, NotImplementedError) as exc:
        raise ModelLoadError(f"{path}: transformers cannot read this GGUF file's config "
                             f"({type(exc).__name__}: {exc})") from exc


def _model_config(hf_config: Any, path: Path) -> ModelConfig:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    raw = hf_config.to_dict()
    # GGUF metadata names an architecture family (general.architecture), not a class.
    architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(raw.get("model_type"))
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {raw.get('model_type')!r} is not supported; "
                         f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
    raw["architectures"] = [architecture]
    # Dequantized weights are float32; a float checkpoint's own dtype is not in the metadata.
    raw["dtype"] = "float32"
    return ModelConfig.from_dict(raw, source=str(path))


def gguf_model_config(path: str | Path) -> ModelConfig:
    """The :class:`ModelConfig` of a GGUF file (its dtype: float32, what dequantizing gives).

    Raises:
        FileNotFoundError, ModelLoadError: see :func:`check_gguf_file`.
        ValueError: an architecture the engine does not support (named).
    """
    path = check_gguf_file(path)
    return _model_config(_hf_config(path), path)


def load_gguf_model(path: str | Path, *, dtype: torch.dtype | str | None = None,
                    device: torch.device | str = "cpu",
                    tp: TPGroup | None = None) -> tuple[CausalLM, ModelConfig]:
    """Read a GGUF file into a :class:`CausalLM` on ``device`` (``tp``'s shard of it).

    Every tensor is dequantized to float32 on the CPU by transformers (``gguf``), cast to the
    load dtype and copied into the model; the whole dequantized state is in host memory once
    during the load (about 4 bytes per parameter, 2 with ``dtype`` float16 / bfloat16).

    Args:
        path: the ``.gguf`` file.
        dtype: None or "auto" (float32), "float32", "float16" or "bfloat16".
        device: where the weights go.

    Returns:
        ``(model, config)``, the model in eval mode without autograd.

    Raises:
        FileNotFoundError, ModelLoadError: see :func:`check_gguf_file`.
        ValueError: an unsupported architecture, a missing or misshapen tensor (named).
    """
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from .loader import TensorCopier

    path = check_gguf_file(path)
    hf_config = _hf_config(path)
    config = _model_config(hf_config, path)
    load_dtype = resolve_dtype(dtype, config)
    # transformers maps GGUF tensor names to Hugging Face ones through a model's parameter
    # names: a model on the meta device has them and costs no memory.
    with torch.device("meta"):
        names_only = AutoModelForCausalLM.from_config(hf_config)
    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=names_only,
                                  torch_dtype=load_dtype)
    tensors: dict[str, torch.Tensor] = parsed["tensors"]
    model = init_empty_model(config, dtype=load_dtype, device=device, tp=tp)
    copier = TensorCopier(model, str(path))
    for name in list(tensors):
        tensor = tensors.pop(name)    # frees each dequantized tensor once copied
        copier.copy(name, lambda part, t=tensor: t if part is None else t[part], str(path))
    copier.finish()
    logger.info("loaded %s from GGUF %s: %d layers, hidden %d, dequantized to %s on %s",
                config.architecture, path, config.num_layers, config.hidden_size, load_dtype,
                device)
    return model, config


def load_gguf_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer stored in a GGUF file (vocabulary, merges, special tokens and chat
    template), built by transformers from the file's metadata.

    Raises:
        FileNotFoundError, ModelLoadError: see :func:`check_gguf_file`.
    """
    from transformers import AutoTokenizer

    path = check_gguf_file(path)
    try:
        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, KeyError, NotImplementedError) as exc:
        raise ModelLoadError(f"{path}: transformers cannot build a tokenizer from this GGUF "
                             f"file ({type(exc).__name__}: {exc})") from exc
    return Tokenizer(hf, name=f"the tokenizer of {path}")


def load_gguf(path: str | Path, *, dtype="auto", device: torch.device | str = "cpu"
              ) -> tuple[CausalLM, ModelConfig, Tokenizer]:
    """``(model, config, tokenizer)`` of a GGUF file (see :func:`load_gguf_model`)."""
    tokenizer = load_gguf_tokenizer(path)
    model, config = load_gguf_model(path, dtype=dtype, device=device)
    return model, config, tokenizer


__all__ = ["GGUF_SUFFIX", "INSTALL_HINT", "check_gguf_file", "gguf_missing", "gguf_model_config",
           "is_gguf_path", "load_gguf", "load_gguf_model", "load_gguf_tokenizer"]
