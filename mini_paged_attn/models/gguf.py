"""GGUF checkpoints (the files llama.cpp users hold), read once.

A ``.gguf`` file carries the model's config, its tokenizer (vocabulary, merges, chat template)
and its weights, often quantized (Q4_0, Q4_1, Q8_0, K-quants, ...). :func:`read_gguf` reads
the header once (``gguf_file.py``); the config and the tokenizer are made from that metadata
with transformers' own GGUF mappings (``gguf_tokenizer.py``), and each tensor is dequantized to
float32 by the ``gguf`` package, processed (Llama's q / k rows un-permuted) and renamed as
transformers' GGUF loader does it, then copied in and freed, one at a time; the engine holds
the weights in the load dtype like any other checkpoint (no quantized matmuls: a Q4 file takes
its float size in memory once loaded). transformers' loader parses the metadata once for the
config, again for the tokenizer and again for the weights (~2 s each for a 49k-token
vocabulary on a small CPU); architectures outside ``_OWN_READER_TYPES`` still go through it.

Families: those the engine supports (Llama, Qwen2, Qwen3); another architecture is refused by
name. The ``gguf`` package is an optional extra: ``pip install -e ".[real]"``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..distributed.group import TPGroup
from ..errors import ModelLoadError
from . import registry
from .config import ModelConfig, resolve_dtype
from .gguf_file import GGUFFile, read_gguf_file
from .gguf_tokenizer import tokenizer_from_metadata
from .llama import CausalLM
from .load_progress import LoadTimer, timer_or_new
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


# GGUF architectures read by this module's own pass over the file (gguf_file.py); the others
# go through transformers' reader (which parses the file once per config, tokenizer and
# weights, and maps tensor names module by module).
_OWN_READER_TYPES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class GGUFCheckpoint:
    """A GGUF file read once: its header (``file``; None when transformers read it), the
    transformers config built from the metadata and the engine's :class:`ModelConfig`."""

    path: Path
    file: GGUFFile | None
    hf_config: Any
    config: ModelConfig


def _config_dict(file: GGUFFile) -> dict[str, Any]:
    """transformers' config fields from the metadata, renamed as its GGUF loader renames them
    (``GGUF_TO_TRANSFORMERS_MAPPING``; single-element arrays as scalars, the tied head from
    the absence of ``output.weight``)."""
    from transformers.integrations import ggml
    from transformers.modeling_gguf_pytorch_utils import GGUF_TO_TRANSFORMERS_MAPPING

    architecture = file.architecture
    # llama.cpp writes Mistral models as "llama"; transformers tells them apart by the name.
    model_arch = ("mistral" if "llama" in architecture
                  and file.metadata.get("general.name") == "mistral" else architecture)
    config: dict[str, Any] = {
        "tie_word_embeddings": all(name != "output.weight" for name in file.tensor_names)}
    defaults = getattr(ggml, "GGUF_CONFIG_DEFAULTS_MAPPING", {})
    for key, value in (defaults.get(model_arch) or defaults.get(architecture) or {}).items():
        config.setdefault(key, value)
    renames = GGUF_TO_TRANSFORMERS_MAPPING["config"]
    for key, value in file.metadata.items():
        prefix, _, rest = key.replace(architecture, model_arch).partition(".")
        renamed = renames.get(prefix, {}).get(rest)
        if renamed is None or renamed == -1:
            continue
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if isinstance(value, str) and architecture in value:
            value = value.replace(architecture, model_arch)
        config[renamed] = value
    tokens = file.metadata.get("tokenizer.ggml.tokens")
    if "vocab_size" not in config and isinstance(tokens, list):
        config["vocab_size"] = len(tokens)
    return config


def _checked_hf_config(build, path: Path) -> Any:
    try:
        return build()
    except (ValueError, KeyError, NotImplementedError) as exc:
        raise ModelLoadError(f"{path}: transformers cannot read this GGUF file's config "
                             f"({type(exc).__name__}: {exc})") from exc


def read_gguf(path: str | Path) -> GGUFCheckpoint:
    """Read the GGUF file ``path`` once: what the tokenizer and the weights are built from.

    Raises:
        FileNotFoundError, ModelLoadError: see :func:`check_gguf_file`.
        ValueError: an architecture the engine does not support (named).
    """
    from transformers import AutoConfig

    path = check_gguf_file(path)
    file = read_gguf_file(path)
    config_dict = _config_dict(file)
    if config_dict.get("model_type") in _OWN_READER_TYPES:
        hf_config = _checked_hf_config(lambda: AutoConfig.for_model(**config_dict), path)
    else:
        file = None
        hf_config = _checked_hf_config(
            lambda: AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name), path)
    return GGUFCheckpoint(path, file, hf_config, _model_config(hf_config, path))


def _model_config(hf_config: Any, path: Path) -> ModelConfig:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    raw = hf_config.to_dict()
    # GGUF metadata names an architecture family (general.architecture), not a class.
    architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(raw.get("model_type"))
    supported = registry.REGISTRY.architectures
    if architecture not in supported:
        raise ValueError(f"{path}: GGUF architecture {raw.get('model_type')!r} is not supported; "
                         f"supported: {supported}")
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
    return read_gguf(path).config


def _as_checkpoint(source: str | Path | GGUFCheckpoint) -> GGUFCheckpoint:
    return source if isinstance(source, GGUFCheckpoint) else read_gguf(source)


def load_gguf_model(source: str | Path | GGUFCheckpoint, *,
                    dtype: torch.dtype | str | None = None,
                    device: torch.device | str = "cpu", tp: TPGroup | None = None,
                    timer: LoadTimer | None = None) -> tuple[CausalLM, ModelConfig]:
    """Read a GGUF file into a :class:`CausalLM` on ``device`` (``tp``'s shard of it).

    Every tensor is dequantized to float32 on the CPU (``gguf.dequantize``), cast to the load
    dtype and copied into the model, one tensor at a time.

    Args:
        source: the ``.gguf`` file, or what :func:`read_gguf` read of it.
        dtype: None or "auto" (float32), "float32", "float16" or "bfloat16".
        device: where the weights go.
        timer: times the "weights" phase, one unit a tensor (see :mod:`.load_progress`).

    Returns:
        ``(model, config)``, the model in eval mode without autograd.

    Raises:
        FileNotFoundError, ModelLoadError: see :func:`check_gguf_file`.
        ValueError: an unsupported architecture, a missing or misshapen tensor (named).
    """
    from .loader import TensorCopier

    checkpoint = _as_checkpoint(source)
    config, path = checkpoint.config, checkpoint.path
    load_dtype = resolve_dtype(dtype, config)
    timer = timer_or_new(timer)
    model = init_empty_model(config, dtype=load_dtype, device=device, tp=tp)
    copier = TensorCopier(model, str(path))
    if checkpoint.file is not None:
        tensors = gguf_tensors(checkpoint, set(copier.targets), load_dtype)
        count = len(checkpoint.file.tensors)
    else:
        parsed = _transformers_tensors(checkpoint, load_dtype)
        tensors, count = parsed.items(), max(1, len(parsed))
    with timer.phase("weights", total=count) as phase:
        for name, tensor in tensors:
            if tensor is None:
                phase.advance()
                continue
            copier.copy(name, lambda part, t=tensor: t if part is None else t[part], str(path))
            phase.advance()
        copier.finish()
    logger.info("loaded %s from GGUF %s: %d layers, hidden %d, dequantized to %s on %s",
                config.architecture, path, config.num_layers, config.hidden_size, load_dtype,
                device)
    return model, config


def gguf_tensors(checkpoint: GGUFCheckpoint, wanted: set[str], dtype: torch.dtype
                 ) -> Iterator[tuple[str, torch.Tensor | None]]:
    """``(Hugging Face name, tensor)`` for each tensor of the file, dequantized to float32 and
    cast to ``dtype`` as transformers' GGUF loader does (its tensor processor undoes llama.cpp's
    permutation of the Llama q / k rows), named through gguf's tensor-name map of the HF
    names in ``wanted``. A tensor no wanted name maps to (Llama 3's ``rope_freqs``: the
    engine makes its own) comes as ``(GGUF name, None)``, not read, as transformers skips it."""
    import numpy as np
    from gguf import MODEL_ARCH_NAMES, dequantize, get_tensor_name_map
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    file = checkpoint.file
    assert file is not None
    config_dict = _config_dict(file)
    arch = next(key for key, value in MODEL_ARCH_NAMES.items()
                if value == config_dict["model_type"])
    name_map = get_tensor_name_map(arch, checkpoint.config.num_layers)
    to_hf: dict[str, str] = {}
    for hf_name in wanted:
        stem, dot, suffix = hf_name.rpartition(".")
        if suffix not in ("weight", "bias"):
            stem, dot, suffix = hf_name, "", ""
        gguf_name = name_map.get_name(stem)
        if gguf_name is not None:
            to_hf[gguf_name + dot + suffix] = hf_name
    processor = TENSOR_PROCESSORS.get(file.architecture, TensorProcessor)(config=config_dict)
    for info in file.tensors:
        if info.name not in to_hf:
            yield info.name, None
            continue
        weights = dequantize(info.data, info.ggml_type)
        result = processor.process(weights=weights, name=info.name, tensor_key_mapping=to_hf,
                                   parsed_parameters={})
        tensor = torch.from_numpy(np.copy(result.weights)).to(dtype)
        yield to_hf.get(result.name, result.name), tensor


def _transformers_tensors(checkpoint: GGUFCheckpoint, dtype: torch.dtype
                          ) -> dict[str, torch.Tensor]:
    """The tensors of a file of another architecture, read by transformers' GGUF loader."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # transformers maps GGUF tensor names to Hugging Face ones through a model's parameter
    # names: a model on the meta device has them and costs no memory.
    with torch.device("meta"):
        names_only = AutoModelForCausalLM.from_config(checkpoint.hf_config)
    return load_gguf_checkpoint(str(checkpoint.path), return_tensors=True,
                                model_to_load=names_only, torch_dtype=dtype)["tensors"]


def load_gguf_tokenizer(source: str | Path | GGUFCheckpoint) -> Tokenizer:
    """The tokenizer stored in a GGUF file (vocabulary, merges, special tokens and chat
    template), built by transformers from the file's metadata (``source``: the file or what
    :func:`read_gguf` read of it).

    Raises:
        FileNotFoundError, ModelLoadError: see :func:`check_gguf_file`.
    """
    checkpoint = _as_checkpoint(source)
    path = checkpoint.path
    try:
        hf = None
        if checkpoint.file is not None:
            hf = tokenizer_from_metadata(checkpoint.file.metadata)
        if hf is None:
            from transformers import AutoTokenizer
            hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, KeyError, NotImplementedError) as exc:
        raise ModelLoadError(f"{path}: transformers cannot build a tokenizer from this GGUF "
                             f"file ({type(exc).__name__}: {exc})") from exc
    return Tokenizer(hf, name=f"the tokenizer of {path}")


def load_gguf(path: str | Path, *, dtype="auto", device: torch.device | str = "cpu",
              timer: LoadTimer | None = None) -> tuple[CausalLM, ModelConfig, Tokenizer]:
    """``(model, config, tokenizer)`` of a GGUF file, which is read once (see
    :func:`load_gguf_model`); ``timer`` times its "config", "tokenizer" and "weights"."""
    timer = timer_or_new(timer)
    with timer.phase("config"):
        checkpoint = read_gguf(path)
    with timer.phase("tokenizer"):
        tokenizer = load_gguf_tokenizer(checkpoint)
    model, config = load_gguf_model(checkpoint, dtype=dtype, device=device, timer=timer)
    return model, config, tokenizer


__all__ = ["GGUFCheckpoint", "GGUF_SUFFIX", "INSTALL_HINT", "check_gguf_file", "gguf_missing",
           "gguf_model_config", "gguf_tensors", "is_gguf_path", "load_gguf", "load_gguf_model",
           "load_gguf_tokenizer", "read_gguf"]
