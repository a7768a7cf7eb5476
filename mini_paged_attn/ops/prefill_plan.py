"""How the Triton prefill kernel tiles a varlen batch: tile sizes and the launch grid.

A tile of the prefill kernel holds ``block_m`` *rows*, and a row is one (query token, query head)
pair: the ``group_size`` query heads that share a KV head are packed next to each other, so one
tile of ``block_m`` rows covers ``tokens_per_tile = block_m // heads_per_tile`` query tokens of
``heads_per_tile`` heads and reads each K/V tile once for all of them. A decode row (q_len 1) of
a GQA-8 model then fills 8 rows of a tile instead of 1.

Sequences are laid out on a flattened tile axis without a host sync: sequence ``i`` owns the
tile slots starting at ``cu_seqlens_q[i] // tokens_per_tile + i`` (strictly increasing in ``i``,
and far enough apart for its ``ceil(q_len_i / tokens_per_tile)`` tiles), so a program finds its
sequence by a binary search over ``cu_seqlens_q`` and the grid size needs only ``total_q`` and
``num_seqs``, both known on the host. A sequence with q_len 0 owns one slot that exits at once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..core.args import cdiv, check_bool, next_pow2
from .checks import check_launch_config
from .triton_support import gluon_prefill_enabled


# A sequence with q_len * group_size <= SMALL_ROWS (decode rows, short chunks) runs a tile of
# SMALL_ROWS rows (the smallest tl.dot M) instead of block_m: a decode row walking a long
# context is memory-bound, and a 128-row tile would spend most of its tensor-core work on
# empty rows.
SMALL_ROWS = 16


@dataclass(frozen=True)
class PrefillConfig:
    """Tile sizes and launch options of the prefill kernel.

    block_m: rows (query token x query head pairs) per tile, a power of two >= 16.
    block_n: K/V tokens per tile, a power of two >= 16, independent of the cache's block_size.
    num_warps, num_stages: Triton launch options (software-pipelining depth of the K/V loads).
    tma: contiguous K/V only: load K/V tiles through tensor descriptors (on Hopper, the bulk
        tensor copy engine) where :func:`tma_usable` allows; paged K/V ignore it.
    """

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3
    tma: bool = False

    def __post_init__(self) -> None:
        check_launch_config(self, ("block_m", "block_n"), max_stages=8)
        check_bool("tma", self.tma)


@dataclass(frozen=True)
class PrefillTiling:
    """The launch geometry derived from a config and the head layout."""

    heads_per_tile: int    # query heads of one KV head packed into a tile (<= block_m)
    head_chunks: int       # tiles needed to cover a whole GQA group (1 unless group > block_m)
    tokens_per_tile: int   # query tokens per tile
    head_size_padded: int  # head_size rounded up to a power of two (>= 16 for tl.dot)
    small_rows: int        # rows of the tile for short sequences (decode rows); 0: none

    def grid(self, total_q: int, num_seqs: int, num_kv_heads: int) -> tuple[int]:
        """Programs = tile slots x kv heads x head chunks on one axis, ordered sequence, then
        head, then slot (a batch's first sequences, e.g. its decode rows, start first, and the
        programs running together share one head's K/V); an upper bound that needs no host
        sync."""
        slots = cdiv(total_q, self.tokens_per_tile) + num_seqs
        return (slots * num_kv_heads * self.head_chunks,)


def tiling(config: PrefillConfig, group_size: int, head_size: int) -> PrefillTiling:
    heads_per_tile = min(group_size, config.block_m)
    return PrefillTiling(
        heads_per_tile=heads_per_tile,
        head_chunks=cdiv(group_size, heads_per_tile),
        tokens_per_tile=config.block_m // heads_per_tile,
        head_size_padded=max(16, next_pow2(head_size)),
        small_rows=SMALL_ROWS if config.block_m > SMALL_ROWS >= heads_per_tile else 0,
    )


# Average q_len (total_q / num_seqs) at or below which a batch counts as decode-heavy.
SHORT_QUERY_AVG = 128


def tma_usable(k: torch.Tensor, v: torch.Tensor, block_n: int) -> bool:
    """Whether contiguous K/V ``[total_k, num_kv_heads, head_size]`` can be read through 2-D
    tensor descriptors over ``[total_k, num_kv_heads * head_size]`` with ``[block_n,
    head_size]`` boxes: fp16 / bf16, a power-of-two head_size >= 16, each row's heads adjacent,
    16-byte aligned bases and row strides, at least one row; on CUDA, a Hopper or newer GPU
    (the CPU interpreter emulates the copies)."""
    head_size = k.shape[2]
    if k.device.type == "cuda" and torch.cuda.get_device_capability(k.device)[0] < 9:
        return False
    return (head_size >= 16 and head_size == next_pow2(head_size) and block_n <= 256
            and k.shape[0] > 0 and all(
                t.dtype in (torch.float16, torch.bfloat16) and _descriptor_rows(t, head_size)
                for t in (k, v)))


def _descriptor_rows(t: torch.Tensor, head_size: int) -> bool:
    """Whether ``t`` (``[..., rows, heads, head_size]``) reads as 2-D tensor-descriptor rows of
    ``heads * head_size`` elements: each row's heads adjacent, and the base and the row stride
    16-byte aligned (what TMA requires)."""
    return (t.stride(-1) == 1 and t.stride(-2) == head_size
            and t.stride(-3) * t.element_size() % 16 == 0 and t.data_ptr() % 16 == 0)


HOPPER_MIN_AVG_Q_LEN = 128
"""Below this average query length a batch runs the Triton kernel, whose tiles pack a GQA
group's heads: the Hopper kernel's 128-token tile of one head would be mostly empty rows."""

HOPPER_MIN_AVG_KV_LEN = 256
"""Below this average K/V length a contiguous batch (whose lengths the host knows from the
shapes) runs the Triton kernel: a Hopper program's fixed cost is then most of its time, and
whole prompts of 128-224 tokens ran 0.7-0.9x as fast as with the Triton kernel on an H100
(docs/performance-notes.md, "Where the Hopper kernel takes over")."""


def hopper_prefill_usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          out: torch.Tensor, num_seqs: int,
                          block_size: int | None = None) -> bool:
    """Whether :mod:`.prefill_hopper` (Gluon) can run a batch: CUDA sm_90, fp16 / bf16 K/V in
    q's dtype, head_size 128, an average query length of at least
    :data:`HOPPER_MIN_AVG_Q_LEN` (and for contiguous K/V an average K/V length of at least
    :data:`HOPPER_MIN_AVG_KV_LEN`), and the layouts its tensor descriptors need: q and out
    ``[rows, heads, 128]``, K/V contiguous ``[rows, heads, 128]`` or (``block_size``) caches
    ``[num_blocks, block_size, heads, 128]`` whose blocks lie end to end with a block size
    of 8 to 128 dividing 128 or a multiple of 128; each token's heads adjacent, 16-byte
    aligned bases and token strides. The variants (windows, softcap, sinks, fp8 scales) are
    the caller's to rule out."""
    if (num_seqs < 1 or q.shape[0] < num_seqs * HOPPER_MIN_AVG_Q_LEN
            or (block_size is None and k.shape[0] < num_seqs * HOPPER_MIN_AVG_KV_LEN)
            or not hopper_prefill_runs_on(q.device, q.shape[2], q.dtype, block_size)):
        return False
    for t in (q, out, k, v):
        if not (t.dtype == q.dtype and t.shape[0] > 0 and _descriptor_rows(t, 128)):
            return False
        if t.dim() == 4 and t.stride(0) != t.shape[1] * t.stride(1):    # blocks end to end
            return False
    return True


def hopper_prefill_runs_on(device: torch.device, head_size: int, dtype: torch.dtype,
                           block_size: int | None = None) -> bool:
    """The device-and-shape side of :func:`hopper_prefill_usable`: CUDA sm_90, fp16 / bf16,
    head_size 128, (paged) a block size the kernel copies as boxes, and a Triton the Gluon
    kernel is tested on (:func:`~.triton_support.gluon_prefill_enabled`, asked last: only
    where the kernel would otherwise run)."""
    if block_size is not None and not hopper_copies_blocks_of(block_size):
        return False
    return (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
            and head_size == 128 and torch.cuda.get_device_capability(device) == (9, 0)
            and gluon_prefill_enabled())


def hopper_copies_blocks_of(block_size: int) -> bool:
    """Whether the Hopper kernel copies a cache's blocks of ``block_size`` tokens into its
    128-row tiles: one box a block (8 to 128 tokens dividing 128; the swizzle repeats every 8
    rows) or 128-row boxes of a larger block (a multiple of 128)."""
    return (8 <= block_size <= 128 and 128 % block_size == 0) or block_size % 128 == 0


def default_config(head_size: int, dtype: torch.dtype, device: torch.device,
                   avg_q_len: float | None = None, contiguous: bool = False) -> PrefillConfig:
    """Tile sizes for a head size, dtype and batch shape (measured on an H100; the numbers are
    in docs/performance-notes.md, "The prefill kernel's tiles").

    - The interpreter (no CUDA) runs every program in numpy: small tiles keep tests quick.
    - head_size 128, whole prompts and chunks: 128 x 128 tiles, 8 warps (one program per SM),
      5 stages where a program may have 225 KiB of shared memory (Hopper), else 3: the paged
      K/V loads lose a stage to the block-table load, and 5 keeps three tiles in flight
      (contiguous K/V: 3 stages, else 2).
    - head_size <= 64: 128 x 64, 4 warps.
    - head_size <= 128, a decode-heavy batch (``avg_q_len <= SHORT_QUERY_AVG``, e.g. decode
      rows mixed with a few prompts): the work is streaming long contexts' K/V; 64 x 64 tiles
      fit two programs per SM, twice the loads in flight.
    - head_size 256: the Q tile plus pipelined K/V tiles must fit in shared memory: 128 x 64,
      8 warps, two stages. fp32 (correctness only): twice the bytes, smaller tiles.
    - Contiguous K/V (``contiguous``, ``flash_attn_varlen_func``), head_size 128, 16-bit, on
      CUDA: the 128 x 128 tiles load K/V through tensor descriptors (``tma``), 3 stages.
    ``avg_q_len`` is known on the host (``total_q / num_seqs``), so the choice needs no sync.
    """
    if device.type != "cuda":
        return PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    padded = max(16, next_pow2(head_size))
    if dtype == torch.float32:
        return PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    if padded > 128:
        return PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)
    if avg_q_len is not None and avg_q_len <= SHORT_QUERY_AVG:
        return PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=3)
    if padded <= 64:
        return PrefillConfig(block_m=128, block_n=64, num_warps=4, num_stages=3)
    deep = max_shared_memory(device) >= THREE_TILE_SHARED_MEMORY
    if contiguous:
        return PrefillConfig(block_m=128, block_n=128, num_warps=8, num_stages=3 if deep else 2,
                             tma=head_size == 128)
    return PrefillConfig(block_m=128, block_n=128, num_warps=8, num_stages=5 if deep else 3)


# Shared memory of 128 x 128 16-bit tiles with three K/V tile pairs in flight (Q + 3 x K, V):
# contiguous K/V at 3 stages, paged K/V at 5 (their table load takes a stage). Hopper has it;
# an A100's 163 KiB holds two pairs.
THREE_TILE_SHARED_MEMORY = 230_400


@functools.lru_cache(maxsize=None)
def max_shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one program may use on ``device`` (Triton's own limit)."""
    from triton.runtime import driver
    index = device.index if device.index is not None else torch.cuda.current_device()
    return driver.active.utils.get_device_properties(index)["max_shared_mem"]
