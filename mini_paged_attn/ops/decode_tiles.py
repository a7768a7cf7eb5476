"""The decode kernel's tiles: :class:`DecodeTiles` and the measured rules that pick them.

Separate from the split planning (:mod:`.attention.decode_plan`): which tile a launch uses
depends only on the head size, dtypes and cache block size (never on the batch), and each rule
rests on its own measurements (docs/performance-notes.md, "The kernel's tiles").
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..core.args import is_int, next_pow2
from .checks import check_launch_config
from .heuristics import wave_efficiency

MAX_BLOCK_N = 256
"""The longest KV tile a planned launch uses (the longest measured: head_size 64, 16-bit)."""


@dataclass(frozen=True)
class DecodeTiles:
    """Tile size and launch options of the decode kernel.

    block_n: KV tokens per tile, a power of two >= 16 (independent of the cache's block_size).
    num_warps, num_stages: Triton launch options; ``num_stages`` is the software-pipelining
        depth, i.e. how many K/V tiles are in flight while one is being used.
    maxnreg: None, or the registers a thread may use (32..255; Triton's ``maxnreg``), which
        lets more programs share an SM. Neither it nor ``num_stages`` changes the result.
    """

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    maxnreg: int | None = None

    def __post_init__(self) -> None:
        check_launch_config(self, ("block_n",), max_stages=12)
        if self.maxnreg is not None and not (is_int(self.maxnreg) and 32 <= self.maxnreg <= 255):
            raise ValueError(f"maxnreg: expected None or an int in 32..255, got {self.maxnreg!r}")


def default_tiles(head_size: int, dtype: torch.dtype, on_gpu: bool, split: bool, *,
                  block_size: int, kv_dtype: torch.dtype | None = None) -> DecodeTiles:
    """Tiles for a head size, dtype and cache block size, and whether the launch splits the KV.

    They never depend on the batch itself, so that a sequence's result with ``num_splits=1``
    does not depend on which batch it is in (the fp8 plan picks registers and stages by the
    batch, :func:`fp8_occupancy_tiles`, which leave the result as it is).

    - Unsplit launches (enough sequences to fill the GPU) read K in 32 KB tiles (128 tokens at
      head_size 128 in 16-bit; 4 warps, 3 stages): two programs per SM with large loads read
      HBM fastest. Cache blocks of 128 tokens or more keep 16 KB tiles (faster there), and
      block_size 1 takes 8 warps to share its per-token table lookups.
    - Split launches (small batches) are latency-bound: 32-token tiles with 5 stages keep two
      K/V tiles in flight behind the block-table loads (the table load takes a stage itself).
    - An fp8 cache (``kv_dtype`` one byte): :data:`FP8_TILES`, split or not (see
      :func:`~.attention.decode_plan.plan_decode` for the split launches of larger batches).
    - Tiles never exceed :data:`MAX_BLOCK_N` tokens: small head sizes would otherwise get tiles
      of thousands of tokens, slow to compile and heavy in registers.

    The measurements behind each rule: docs/performance-notes.md, "The kernel's tiles".

    The interpreter runs every program in numpy: small tiles keep tests quick and still span
    several blocks.
    """
    if not on_gpu:
        return DecodeTiles(block_n=16, num_warps=4, num_stages=1)
    if kv_dtype is not None and kv_dtype.itemsize == 1:
        return FP8_TILES
    # One token of K as the kernel holds it (head_size padded to a power of two >= 16).
    row_bytes = max(16, next_pow2(head_size)) * torch.finfo(dtype).bits // 8
    if split:
        if row_bytes <= 128:      # head_size <= 64 in 16-bit
            return DecodeTiles(block_n=128, num_warps=4, num_stages=3)
        if row_bytes <= 256:      # head_size <= 128 in 16-bit
            return DecodeTiles(block_n=32, num_warps=4, num_stages=5)
        return DecodeTiles(block_n=32, num_warps=4, num_stages=3)
    tile_bytes = 16384 if block_size >= 128 else 32768
    return DecodeTiles(block_n=min(MAX_BLOCK_N, max(16, tile_bytes // row_bytes)),
                       num_warps=8 if block_size == 1 else 4, num_stages=3)


def fp8_v_conversion(head_size: int, head_size_padded: int, on_gpu: bool,
                     even_layout: bool = True) -> str:
    """How a launch over an fp8 cache with fp16 dots turns its V tiles into fp16 (the kernel's
    ``FP8_V``): ``"pairs"`` on a GPU where the head size is its own padding (a power of two)
    and the value cache is laid out for int16 reads (``even_layout``: even strides, an aligned
    pointer), else ``"cast"`` (the interpreter runs no inline PTX).

    By ``.to`` the compiler reads an 8-bit V tile from shared memory a byte at a time into
    the PV dot's operand layout (256 ``LDS.U8`` per thread at 128 tokens / 2 warps): the
    dot's reduction axis, the tokens, is strided in the cache and sm_90 has no 8-bit
    transposing ``ldmatrix``. Read as int16 pairs of dims, the tile takes the 16-bit path
    (``ldmatrix.trans``) and is converted in the dot's layout, the PV dot split into even and
    odd dims, which reads more of the copy bandwidth at every shape measured
    (docs/performance-notes.md, "fp8 V read as pairs of dims")."""
    return "pairs" if on_gpu and even_layout and head_size == head_size_padded else "cast"


FP8_TILES = DecodeTiles(block_n=64, num_warps=2, num_stages=6)
"""Decode over an fp8 cache (head_size 128, bf16 queries, fp16 dots, V read as pairs):
64-token tiles, 2 warps, 6 stages, split or not, the tiles that read the most of the copy
bandwidth among those measured (docs/performance-notes.md, "Figures behind the code's
rules"). Compiled for sm_90 a program takes 186 registers a thread and 38.5 KB of shared
memory: 4 run at once on an SM."""

FP8_OCCUPANCY = (
    (FP8_TILES, 4),
    (replace(FP8_TILES, maxnreg=168), 5),
    (replace(FP8_TILES, num_stages=4, maxnreg=168), 6),
    (replace(FP8_TILES, num_stages=3, maxnreg=128), 8),
)
""":data:`FP8_TILES` and the same tiles with fewer registers or stages, each with the
programs that run at once on an SM (sm_90: 4 with 186 registers a thread and 38.5 KB of
shared memory; 5 at 168 registers; 6 at 168 registers and 4 stages, 22 KB; 8 at 128
registers and 3 stages). Registers and stages change how many programs share an SM, never a
result (the same tiles sum the same products in the same order)."""


def fp8_occupancy_tiles(programs: int, num_sms: int) -> DecodeTiles:
    """The :data:`FP8_OCCUPANCY` tiles whose last wave of ``programs`` is fullest (the first
    of equals, so the default where no other does better).

    An fp8 program reads its tiles more slowly than an SM's share of the bandwidth, so an SM
    that runs out of programs before the others idles its share; fewer registers or stages
    that fit more programs an SM and so fill the last wave read as much as full waves do
    (docs/performance-notes.md, "fp8 decode across batch sizes")."""
    tiles, _ = max(FP8_OCCUPANCY, key=lambda entry: wave_efficiency(programs,
                                                                    entry[1] * num_sms))
    return tiles


__all__ = ["DecodeTiles", "default_tiles", "fp8_occupancy_tiles", "fp8_v_conversion",
           "FP8_OCCUPANCY", "FP8_TILES", "MAX_BLOCK_N"]
