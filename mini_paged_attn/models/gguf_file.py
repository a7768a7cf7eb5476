"""One pass over a GGUF file's header: its metadata and its tensor table, tensors left mapped.

A GGUF file (v2 / v3) is a header, the metadata (key, type, value; a vocabulary and its merges
are arrays of tens of thousands of strings), a table of tensors (name, dims, ggml type, offset)
and then the tensor data, aligned. :func:`read_gguf_file` walks the header once with ``struct``
over an ``mmap`` (the ``gguf`` package's reader builds numpy views of every field, ~2 s for a
49k-token vocabulary on a small CPU) and maps the data without reading it: each tensor is a
numpy view of the mapped file, shaped and typed exactly as ``gguf.GGUFReader`` gives it, so
``gguf.dequantize`` turns it into the same floats.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ModelLoadError

# Metadata value types: struct formats of the fixed-width ones (8: string, 9: array).
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
                   11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# Plain (unquantized) ggml types as gguf.GGUFReader maps them; every other type is blocks
# of bytes.
_PLAIN_DTYPES = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32,
                 27: np.int64, 28: np.float64}
_DEFAULT_ALIGNMENT = 32
_VERSIONS = (2, 3)


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of the file: ``data`` is a read-only view of the mapped file (uint8 blocks of
    shape ``(..., row_bytes)`` for a quantized type, else the values in ``dims`` reversed)."""

    name: str
    ggml_type: int
    dims: tuple[int, ...]     # ggml order (fastest-varying first)
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    """What :func:`read_gguf_file` found: ``metadata`` maps each key to its Python value
    (ints, floats, bools, strs, lists of them), ``tensors`` in file order."""

    path: Path
    metadata: dict[str, Any]
    tensors: tuple[GGUFTensorInfo, ...]

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)


class _Cursor:
    """Reads little-endian values from ``buf`` at a moving offset."""

    def __init__(self, buf: mmap.mmap, where: str) -> None:
        self.buf, self.pos, self.where = buf, 0, where

    def unpack(self, fmt: str) -> tuple:
        try:
            values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        except struct.error as exc:
            raise ModelLoadError(f"{self.where}: the GGUF header ends early at byte {self.pos}; "
                                 "the file may be truncated") from exc
        self.pos += struct.calcsize("<" + fmt)
        return values

    def string(self) -> str:
        (length,) = self.unpack("Q")
        end = self.pos + length
        if end > len(self.buf):
            raise ModelLoadError(f"{self.where}: a string of {length} bytes at byte {self.pos} "
                                 "runs past the end of the file; it may be truncated")
        text = self.buf[self.pos:end].decode("utf-8", errors="replace")
        self.pos = end
        return text

    def value(self, value_type: int) -> Any:
        if value_type in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[value_type])[0]
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            element_type, count = self.unpack("IQ")
            if element_type in _SCALAR_FORMATS:
                return list(self.unpack(f"{count}{_SCALAR_FORMATS[element_type]}"))
            return [self.value(element_type) for _ in range(count)]
        raise ModelLoadError(f"{self.where}: unknown GGUF metadata type {value_type} at byte "
                             f"{self.pos}")


def read_gguf_file(path: str | Path) -> GGUFFile:
    """The metadata and the tensor table of the GGUF file ``path``, tensors mapped, not read.

    Raises:
        ModelLoadError: not a GGUF file, an unknown version or type, or a truncated file.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    path = Path(path)
    with path.open("rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(buf, str(path))
    magic, version, tensor_count, kv_count = cur.unpack("4sIQQ")
    if magic != b"GGUF" or version not in _VERSIONS:
        raise ModelLoadError(f"{path}: expected a GGUF v2 / v3 file, got magic {magic!r}, "
                             f"version {version}")
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cur.string()
        (value_type,) = cur.unpack("I")
        metadata[key] = cur.value(value_type)
    if "general.architecture" not in metadata:
        raise ModelLoadError(f"{path}: no general.architecture in the GGUF metadata")
    table = []
    for _ in range(tensor_count):
        name = cur.string()
        (n_dims,) = cur.unpack("I")
        dims = cur.unpack(f"{n_dims}Q")
        ggml_type, offset = cur.unpack("IQ")
        table.append((name, tuple(int(d) for d in dims), ggml_type, offset))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-cur.pos // alignment) * alignment
    # numpy keeps the mapping alive for as long as a tensor view of it exists.
    blob = np.frombuffer(buf, dtype=np.uint8)
    tensors = []
    for name, dims, ggml_type, offset in table:
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError) as exc:
            raise ModelLoadError(f"{path}: tensor {name!r} has unknown ggml type "
                                 f"{ggml_type}") from exc
        np_dims = tuple(reversed(dims))
        n_bytes = int(np.prod(dims, dtype=np.int64)) * type_size // block
        start = data_start + offset
        if start + n_bytes > len(blob):
            raise ModelLoadError(f"{path}: tensor {name!r} runs past the end of the file; it "
                                 "may be truncated")
        raw = blob[start:start + n_bytes]
        if ggml_type in _PLAIN_DTYPES:
            data = raw.view(_PLAIN_DTYPES[ggml_type]).reshape(np_dims)
        else:
            data = raw.reshape(quant_shape_to_byte_shape(np_dims, GGMLQuantizationType(ggml_type)))
        tensors.append(GGUFTensorInfo(name, ggml_type, dims, data))
    return GGUFFile(path, metadata, tuple(tensors))


__all__ = ["GGUFFile", "GGUFTensorInfo", "read_gguf_file"]
