"""The decode kernel's tiles: :class:`DecodeTiles` and the measured rules that pick them.

Separate from the split planning (:mod:`.explain`): which tile a launch uses depends only on
the head size, dtypes and cache block size (never on the batch), and each rule rests on its own
measurements (docs/performance-notes.md, "The kernel's tiles").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.args import next_pow2
from .checks import check_launch_config

MAX_BLOCK_N = 256
"""The longest KV tile a planned launch uses (the longest measured: head_size 64, 16-bit)."""


@dataclass(frozen=True)
class DecodeTiles:
    """Tile size and launch options of the decode kernel.

    block_n: KV tokens per tile, a power of two >= 16 (independent of the cache's block_size).
    num_warps, num_stages: Triton launch options; ``num_stages`` is the software-pipelining
        depth, i.e. how many K/V tiles are in flight while one is being used.
    """

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        check_launch_config(self, ("block_n",), max_stages=12)


def default_tiles(head_size: int, dtype: torch.dtype, on_gpu: bool, split: bool, *,
                  block_size: int, kv_dtype: torch.dtype | None = None) -> DecodeTiles:
    """Tiles for a head size, dtype and cache block size, and whether the launch splits the KV.

    They never depend on the batch itself, so that a sequence's result with ``num_splits=1``
    does not depend on which batch it is in.

    - Unsplit launches (enough sequences to fill the GPU) read K in 32 KB tiles (128 tokens at
      head_size 128 in 16-bit; 4 warps, 3 stages): two programs per SM with large loads read
      HBM fastest. Cache blocks of 128 tokens or more keep 16 KB tiles (faster there), and
      block_size 1 takes 8 warps to share its per-token table lookups.
    - Split launches (small batches) are latency-bound: 32-token tiles with 5 stages keep two
      K/V tiles in flight behind the block-table loads (the table load takes a stage itself).
    - An fp8 cache (``kv_dtype`` one byte): :data:`FP8_TILES`, split launches of small
      batches :data:`FP8_SPLIT_TILES` (see :func:`~.explain.plan_decode` for the split
      launches of larger ones).
    - Tiles never exceed :data:`MAX_BLOCK_N` tokens: small head sizes would otherwise get tiles
      of thousands of tokens, slow to compile and heavy in registers.

    The measurements behind each rule (H100): docs/performance-notes.md, "The kernel's tiles".

    The interpreter runs every program in numpy: small tiles keep tests quick and still span
    several blocks.
    """
    if not on_gpu:
        return DecodeTiles(block_n=16, num_warps=4, num_stages=1)
    if kv_dtype is not None and kv_dtype.itemsize == 1:
        return FP8_SPLIT_TILES if split else FP8_TILES
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


def fp8_v_asm(tiles: DecodeTiles, head_size_padded: int) -> bool:
    """Whether a launch over an fp8 cache with fp16 dots converts V with the kernel's opaque
    ``e4m3_to_fp16`` (``FP8_V_ASM``): where each thread's share of the fp16 V tile fits in 32
    registers (128 bytes).

    Converted by ``.to``, the compiler reads V from shared memory a byte at a time (256
    ``LDS.U8`` per thread at 128 tokens / 2 warps); the opaque conversion reads 16-byte rows
    and transposes the fp16 tile with ``ldmatrix``, a third fewer instructions per tile, but
    holds the fp16 tile in registers: at 128 tokens / 2 warps (256 bytes a thread) it spills.
    H100, % of copy bandwidth over fp8 bytes at 64x4k / 256x4k / 128x16k: 64/2/6 90.9 / 93.4 /
    93.3 opaque against 87.7 / 89.1 / 91.2 by ``.to``; 128/2/3 61.9 / 72.2 / 75.2 opaque
    (spilling) against 89.5 / 92.8 / 94.0 (docs/performance-notes.md)."""
    per_thread = tiles.block_n * head_size_padded * 2 // (32 * tiles.num_warps)
    return per_thread <= 128


FP8_TILES = DecodeTiles(block_n=128, num_warps=2, num_stages=3)
"""Decode over an fp8 cache (H100, head_size 128, bf16 queries, fp16 dots), unsplit: 128-token
tiles, 2 warps, 3 stages read 93-95% of copy bandwidth with 1024 programs or more (256x4k,
128x16k) and 91% at 512, but 63% at 256: :func:`~.explain.plan_decode` splits such launches
(32x64k in 4 splits: 94%). 64/2/6 read 88-92% at every size; the 16-bit rule's 128/4/3
76-84%."""

FP8_SPLIT_TILES = DecodeTiles(block_n=64, num_warps=2, num_stages=6)
"""Split launches of small batches over an fp8 cache, which are bound by latency: 64/2/6 took
26 us at 1 x 16k (bf16: 34 us), where 128/2/3 in 128 splits took 32 us."""


__all__ = ["DecodeTiles", "default_tiles", "fp8_v_asm", "FP8_SPLIT_TILES", "FP8_TILES",
           "MAX_BLOCK_N"]
