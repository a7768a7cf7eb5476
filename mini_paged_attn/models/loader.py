"""Load a Hugging Face model directory (config.json + *.safetensors) straight onto the device.

Each checkpoint tensor is read by ``safetensors.safe_open(device=...)`` directly onto the target
device in its stored dtype, then copied (and cast) into its rows of the already allocated
parameters, so peak extra memory is one tensor: no full-precision copy of the model on the CPU.
Sharded checkpoints are read through ``model.safetensors.index.json``. Under tensor parallelism
each rank reads only its part of each tensor (``safe_open(...).get_slice(name)[part]`` reads
those bytes alone), so a rank's memory holds its shard and nothing more.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..distributed.group import TPGroup
from ..errors import ModelLoadError
from .checkpoint import check_unquantized, read_part
from .config import ModelConfig, check_model_dir, read_json, resolve_dtype
from .gguf import is_gguf_path, load_gguf_model
from .llama import CausalLM
from .load_progress import LoadTimer, timer_or_new
from .packaged import resolve_model
from .registry import init_empty_model

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of ``model_dir``: the shards its index names, or every *.safetensors.

    Raises:
        FileNotFoundError: the directory, a shard named by the index, or any safetensors file is
            missing (the message names it).
    """
    model_dir = check_model_dir(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map") or {}
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index}: names shard files that do not exist: {missing}")
        if not files:
            raise FileNotFoundError(f"{index}: its weight_map names no files")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model_dir: no *.safetensors file in {str(model_dir)!r} "
                                "(only safetensors checkpoints are supported)")
    return files


def load_weights(model: CausalLM, files: list[Path], device: torch.device | str,
                 timer: LoadTimer | None = None) -> None:
    """Copy every tensor of ``files`` (this rank's part of it) into ``model`` (cast to its
    dtype); ``timer`` times it as the "weights" phase, one unit a file.

    Raises:
        ValueError: a tensor the model needs is absent from every file, or a tensor's shape does
            not match its parameter (names the tensor and file).
        ModelLoadError: a file is not a readable safetensors file (truncated, say; named).
    """
    from safetensors import SafetensorError, safe_open

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    device_str = str(device)
    copier = TensorCopier(model, str(files[0].parent))
    with timer_or_new(timer).phase("weights", total=len(files)) as phase:
        for path in files:
            try:
                opened = safe_open(str(path), framework="pt", device=device_str)
            except SafetensorError as exc:
                raise ModelLoadError(
                    f"{path}: expected a safetensors file, got one that cannot be read "
                    f"({exc}); it may be truncated: download it again") from exc
            with opened as f:
                for name in f.keys():
                    copier.copy(name, lambda part, f=f, name=name: read_part(f, name, part),
                                str(path))
            phase.advance()
        copier.finish()


class TensorCopier:
    """Copies checkpoint tensors, by Hugging Face name, into the parameters of ``model`` (this
    rank's part of each), then checks that every parameter was filled.

    ``source`` names the checkpoint in error messages.
    """

    def __init__(self, model: CausalLM, source: str) -> None:
        self.model = model
        self.source = source
        self.targets = model.checkpoint_shards()
        self.loaded: set[str] = set()
        self.unexpected: list[str] = []

    @torch.no_grad()
    def copy(self, name: str, read: Callable[[tuple[slice, ...] | None], torch.Tensor],
             where: str) -> None:
        """Copy tensor ``name`` (``read(part)`` gives its ``part``, None: all of it; any
        dtype, cast to the parameter's) from ``where`` (a file, named in errors).

        Raises:
            ValueError: its shape does not match its parameter's.
        """
        shard = self.targets.get(name)
        if shard is None:
            if not self.model.is_ignored_checkpoint_tensor(name):
                self.unexpected.append(name)
            return
        target, part = shard
        tensor = read(part)
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"{where}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"the model expects {tuple(target.shape)} "
                             "(the config does not match the weights)")
        target.copy_(tensor)
        self.loaded.add(name)

    def finish(self) -> None:
        """Raises ValueError naming the tensors the model needs that no copy brought."""
        missing = sorted(set(self.targets) - self.loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (f", ... ({len(missing)} in all)"
                                              if len(missing) > 5 else "")
            raise ValueError(f"checkpoint {self.source}: missing tensors {shown}")
        if self.unexpected:
            logger.warning("checkpoint %s: %d tensors the model does not use, e.g. %s",
                           self.source, len(self.unexpected), self.unexpected[:3])


def load_model(model_dir: str | Path, *, dtype: torch.dtype | str | None = None,
               device: torch.device | str = "cpu",
               tp: TPGroup | None = None, timer: LoadTimer | None = None
               ) -> tuple[CausalLM, ModelConfig]:
    """Read a Hugging Face model directory into a :class:`CausalLM` on ``device`` (``tp``'s
    shard of it: each rank calls this with its group).

    Args:
        model_dir: holds config.json and model.safetensors (or shards + index); or a ``.gguf``
            file (see :mod:`.gguf`: dequantized while it loads; needs the ``gguf`` package).
        dtype: torch.float32 / float16 / bfloat16 (or their names); None or "auto" keeps the
            checkpoint's (config.json ``torch_dtype`` / ``dtype``).
        device: where the weights go (read there directly).
        timer: times the "config" and "weights" phases (see :mod:`.load_progress`).

    Returns:
        ``(model, config)``, the model in eval mode without autograd.

    Raises:
        FileNotFoundError: no config.json / no safetensors / a missing shard (named).
        ValueError: unsupported architecture (named, with the supported ones), a bad config
            field, a missing or misshapen tensor (named), a quantized checkpoint (its
            quant_method, or the quantized tensor, named; before any weight is read).
    """
    if is_gguf_path(model_dir):
        return load_gguf_model(model_dir, dtype=dtype, device=device, tp=tp, timer=timer)
    timer = timer_or_new(timer)
    config, files = read_checkpoint(model_dir, timer)
    return load_checkpoint(model_dir, config, files, dtype=dtype, device=device, tp=tp,
                           timer=timer), config


def read_checkpoint(model_dir: str | Path, timer: LoadTimer) -> tuple[ModelConfig, list[Path]]:
    """The "config" phase of :func:`load_model`: the model's config and its safetensors
    files, checked unquantized."""
    with timer.phase("config"):
        config = ModelConfig.from_model_dir(model_dir)
        files = checkpoint_files(model_dir)
        # Before the model is allocated: a quantized checkpoint read as plain weights
        # answers garbage.
        config_path = Path(model_dir) / "config.json"
        check_unquantized(read_json(config_path), files, str(config_path))
    return config, files


def load_checkpoint(model_dir: str | Path, config: ModelConfig, files: list[Path], *, dtype,
                    device, tp: TPGroup | None, timer: LoadTimer) -> CausalLM:
    """The rest of :func:`load_model` after :func:`read_checkpoint`: the model allocated on
    ``device`` and its weights read in (the "weights" phase)."""
    load_dtype = resolve_dtype(dtype, config)
    model = init_empty_model(config, dtype=load_dtype, device=device, tp=tp)
    load_weights(model, files, device, timer)
    rank = "" if tp is None or tp.world_size == 1 else f" (rank {tp.rank} of {tp.world_size})"
    logger.info("loaded %s from %s: %d layers, hidden %d, %s on %s%s", config.architecture,
                model_dir, config.num_layers, config.hidden_size, load_dtype, device, rank)
    return model


# Name of the embedded random tiny model (models/tiny.py) where a model directory is expected.
TINY_MODEL = "tiny"


def load_model_and_tokenizer(model: str | Path, *, dtype="auto", device=None,
                             timer: LoadTimer | None = None):
    """``(CausalLM, ModelConfig, Tokenizer)`` from a local Hugging Face directory, a ``.gguf``
    file, a packaged model's name (``"smollm2-135m"``, see models/packaged.py), or the
    embedded tiny random Llama for ``model="tiny"``.

    ``timer`` (see :mod:`.load_progress`) times the phases "config", "tokenizer" and
    "weights" (one unit a tensor of a GGUF file, a file of a safetensors checkpoint)."""
    net, config, tokenizer = start_loading(model, dtype=dtype, device=device, timer=timer)
    return net, config, tokenizer.result()


def start_loading(model: str | Path, *, dtype="auto", device=None,
                  timer: LoadTimer | None = None, tokenizer: str | Path | None = None
                  ) -> tuple[CausalLM, ModelConfig, Future]:
    """:func:`load_model_and_tokenizer`, with the tokenizer still loading: ``(CausalLM,
    ModelConfig, Future of the Tokenizer)``.

    A Hugging Face directory's tokenizer (or ``tokenizer``'s, a directory whose tokenizer
    replaces the model's) loads on a thread of its own, beside the weights and whatever the
    caller builds before it asks for ``result()`` (the engine's KV pool, CUDA graphs and
    warm-up). The config is read first, on this thread, without transformers: the tokenizer's
    thread is the one that imports it (two threads importing it at once can fail to import a
    name of its lazy modules, so nothing else of the load may). The paths are checked first too
    (a missing tokenizer is a FileNotFoundError here, not in ``result()``). A GGUF file and the
    tiny model make their tokenizer with the weights: the Future is already done.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    timer = timer_or_new(timer)
    from .tokenizer import check_tokenizer_dir, load_tokenizer
    other = None if tokenizer is None else check_tokenizer_dir(tokenizer)
    if str(model) != TINY_MODEL:
        model = resolve_model(model)
    if str(model) == TINY_MODEL or is_gguf_path(model):
        net, config, own = _load_with_tokenizer(model, dtype, device, timer)
        done: Future = Future()
        done.set_result(own if other is None else load_tokenizer(other))
        return net, config, done
    source = other if other is not None else check_tokenizer_dir(model)
    config, files = read_checkpoint(model, timer)

    def load() -> Tokenizer:
        with timer.phase("tokenizer", concurrent=True):
            return load_tokenizer(source)

    pool = ThreadPoolExecutor(1, thread_name_prefix="tokenizer-load")
    pending = pool.submit(load)
    pool.shutdown(wait=False)      # the thread ends with its one job
    net = load_checkpoint(model, config, files, dtype=dtype, device=device, tp=None,
                          timer=timer)
    return net, config, pending


def _load_with_tokenizer(model: str | Path, dtype, device: torch.device, timer: LoadTimer):
    """The tiny model or a GGUF file (``model`` resolved): weights, config and tokenizer in
    one load."""
    if str(model) == TINY_MODEL:
        from .config import parse_dtype
        from .tiny import tiny_llama
        with timer.phase("weights"):
            return tiny_llama(device, torch.float32 if dtype in (None, "auto")
                              else parse_dtype(dtype))
    from .gguf import load_gguf
    return load_gguf(model, dtype=dtype, device=device, timer=timer)
