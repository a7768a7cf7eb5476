"""How paged decode runs and why: the launch plan (tiles, splits, merge), shared by the Triton
launcher and :func:`explain_decode`.

One program of the decode kernel serves one (sequence, KV head, split): all ``group_size``
query heads of that KV head, so each K/V tile is read once per group. When ``num_seqs x
num_kv_heads`` programs cannot fill the GPU, each sequence's KV is split into ``num_splits``
chunks ("flash decoding"); their partial results are merged by their log-sum-exp, in a
second kernel or by each group's last split inside the decode kernel (:data:`FUSED_MERGE`). The number of splits comes from FlashAttention's heuristic (seed 003), fed with
this kernel's own figures: its KV tile (``block_n``) and how many of its programs fit on one SM.

Planning reads nothing from the device but its SM count, so a launch needs no host sync: the
planned context length is the block table's capacity (``max_blocks_per_seq * block_size``).
Each sequence divides *its own* length among the splits, and splits left without work exit at
once, so planning for the capacity costs a few idle programs, never wrong results.

A sliding window (``window_size=(left, _)``) bounds what one query reads to ``left + 1`` keys,
which may start anywhere in a tile: the plan counts the tiles such a run can touch,
``ceil((left + block_n) / block_n)``, instead of the capacity's, so a windowed layer of a
long-context model splits as a short context would. Either way the split count stays within
what the caller's workspace holds (``max_splits``).

The tiles themselves (:class:`~mini_paged_attn.ops.decode_tiles.DecodeTiles`, chosen by
:func:`~mini_paged_attn.ops.decode_tiles.default_tiles`) come from :mod:`mini_paged_attn.ops.decode_tiles`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ...core.args import cdiv, check_bool, is_int, next_pow2, non_negative_int, positive_int
from ..decode_tiles import (FP8_OCCUPANCY, FP8_TILES, MAX_BLOCK_N, DecodeTiles,
                            default_tiles, fp8_occupancy_tiles)
from ..heuristics import num_splits_heuristic, wave_efficiency
from ..kv_quant import FP8_DTYPE
from ..variants import check_window

FUSED_MERGE = True
"""Whether a split-KV ``paged_decode`` call without a ``workspace`` merges the splits inside
the decode kernel (one launch; the last program of each sequence and KV head merges, see
:mod:`mini_paged_attn.ops.decode_kernel`) rather than in a second kernel. Such calls are eager loops at small
batches, host-bound, where a launch less is host time saved. Calls with a workspace, what
CUDA-graph capture takes (the engine's decode steps), keep the separate merge kernel, whether
eager or captured: the warm-up call before a capture then compiles what the capture launches,
and graphs keep the merge that measured faster on the GPU at batch 1 (see
:mod:`mini_paged_attn.ops.decode_merge`)."""

MAX_SPLITS = 128
"""The most KV splits of one sequence (FlashAttention's cap, too)."""

PROGRAMS_PER_SM = 2
"""Programs per SM in the split heuristic's wave (``num_sms * PROGRAMS_PER_SM``), as
FlashAttention counts (two thread blocks per SM). Our unsplit programs at head_size 128 use
~190 registers a thread, so 2 fit on an SM; the split launches' smaller tiles would fit 5, but
the heuristic's choices were tuned (measured) with this count."""

SPLIT_PROGRAMS_PER_SM = 4
"""Programs per SM in the wave the split count is chosen for, once a launch over a 16-bit cache
splits (its programs are too few for :data:`PROGRAMS_PER_SM` a SM): split programs use the
small split tiles, of which 4 fit on an SM. Counted with 2, the heuristic left mid batches at
long contexts a wave short of the bandwidth: on an H200, 8 x 16k took 150 us in 4 splits and
134 us in 8, where cuDNN SDPA took 130 us; 1 x 64k 81 us in 32 and 75 us in 64
(docs/performance-notes.md, "Split counts of mid batches"). Only for splits that would run more
than :data:`SHORT_SPLIT_TILES` tiles each on 2 a SM."""

SHORT_SPLIT_TILES = 4
"""Split tiles a split of the 2-a-SM plan runs at most for that plan to stay (4 tiles are 128
tokens at head_size 128 in 16-bit): such short splits wait on their block-table
loads and merge, and doubling them bought nothing (H200: 1 x 4k, 16.0 us in 32 splits, 16.4 in
64; 1 x 2k, 13.7 and 13.9)."""

FP8_PROGRAMS_PER_SM = 8
"""Programs per SM that a launch of short sequences over an fp8 cache, taken longest first,
splits toward when it has enough programs for the 16-bit rule but fewer than
:data:`FP8_SPLIT_BELOW` per SM (keeping the unsplit tiles); smaller batches split as 16-bit
ones do."""

FP8_SPLIT_BELOW = 3.2
"""Programs per SM under which a launch of short sequences (:data:`FP8_SHORT_TILES`) over an
fp8 cache, taken longest first, splits toward :data:`FP8_PROGRAMS_PER_SM` (see
:data:`FP8_ORDERED_UNSPLIT`). Longer sequences stay unsplit wherever the 16-bit rule leaves
them so: with the fp8 tiles of :data:`~mini_paged_attn.ops.decode_tiles.FP8_TILES` (V read
as pairs) unsplit they read more of the copy bandwidth than split toward 8 a SM, at every
shape measured but one (docs/performance-notes.md, "Figures behind the code's rules")."""

FP8_SHORT_TILES = 32
"""An fp8 launch with enough programs for the 16-bit rule (which leaves it unsplit) splits in
exactly 2, instead of as :data:`FP8_SPLIT_BELOW` says, when the tiles its longest sequence
can touch (a window's, with one) fit this many of its 64-token tiles (2k tokens): programs
this short start and end unevenly, and halving them evens the SMs' load; at 4k tokens the
unsplit launch stays ahead (docs/performance-notes.md, "fp8 at the engine's shapes"). A
launch that takes its sequences longest first (``seq_order``) is already even: see
:data:`FP8_ORDERED_UNSPLIT`."""

FP8_ORDERED_UNSPLIT = 6
"""Programs per SM from which a launch of short sequences (:data:`FP8_SHORT_TILES`) over an
fp8 cache, taking them longest first, stays unsplit; under :data:`FP8_SPLIT_BELOW` a SM it
splits as that rule says, and in between in 2. The order already evens the SMs' load, and
halving the programs only adds partials to merge; with fewer programs a SM, splitting fills
the SMs better (docs/performance-notes.md, "fp8 decode in longest-first order")."""

ASSUMED_NUM_SMS = 132
"""SM count used for planning when no CUDA device is given (an H100 or H200)."""


@functools.lru_cache(maxsize=None)
def num_sms_of(device: torch.device | None) -> int:
    """Multiprocessors of a CUDA device (read once per device), else :data:`ASSUMED_NUM_SMS`."""
    if device is None or device.type != "cuda":
        return ASSUMED_NUM_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).multi_processor_count


BALANCE_TOLERANCE = 0.02
"""How much longer than the shortest a split's run of KV tiles may be (see balance_splits)."""


def balance_splits(splits: int, units: int, wave_slots: int, num_tiles: int,
                   max_splits: int) -> int:
    """The split count a launch uses, given FlashAttention's choice ``splits``.

    FlashAttention's heuristic counts waves, not the work of each program: a split runs
    ``ceil(num_tiles / splits)`` KV tiles, and the launch lasts as long as its longest split.
    More splits cost nothing while the programs still fit in as many waves, so among the counts
    from ``splits`` up to the last that does, take the fewest whose longest split is within
    :data:`BALANCE_TOLERANCE` of the shortest possible (each split adds partials to merge).
    At batch 1 and 64k tokens (8 KV heads, 2048 tiles), FlashAttention's 29 splits run 71
    tiles each, 32 splits 64: the even count is the faster (docs/performance-notes.md,
    "Figures behind the code's rules").
    """
    waves = cdiv(units * splits, wave_slots)
    candidates = [s for s in range(splits, max(splits, max_splits) + 1)
                  if cdiv(units * s, wave_slots) == waves]
    shortest = min(cdiv(num_tiles, s) for s in candidates)
    return next(s for s in candidates
                if cdiv(num_tiles, s) <= shortest * (1 + BALANCE_TOLERANCE))


@dataclass(frozen=True)
class DecodePlan:
    """Everything the decode launch decides, with the figures behind the decision.

    ``str(plan)`` is a short human explanation.
    """

    num_seqs: int
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype
    max_context_len: int      # the length planned for (the block table's capacity at launch)
    tiles: DecodeTiles
    num_sms: int
    num_splits: int
    split_reason: str         # "forced", "enough programs", "heuristic", "fp8 programs",
                              # "fp8 short"
    heuristic_splits: int | None = None    # FlashAttention's choice, before balance_splits
    heuristic_kv_tiles: int | None = None  # the num_n_blocks it was given (split tiles)
    kv_dtype: torch.dtype | None = None    # the cache's dtype when not the query's (fp8)
    window_left: int = -1     # the sliding window's left side (-1: none)
    fused_merge: bool = False  # split launches: the decode kernel merges (no merge launch)
    ordered: bool = False     # the launch takes its sequences longest first (seq_order)
    programs_per_sm: int = PROGRAMS_PER_SM   # the wave the split count was chosen for

    @property
    def fp16_dots(self) -> bool:
        """An fp8 cache with 16-bit queries: the dots run in fp16 (see :mod:`mini_paged_attn.ops.decode_kernel`)."""
        return (self.kv_dtype is not None and self.kv_dtype.itemsize == 1
                and self.dtype in (torch.float16, torch.bfloat16))

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def block_h(self) -> int:
        """Query-head rows of a tile: the group padded to a power of two >= 16 (``tl.dot``)."""
        return max(16, next_pow2(self.group_size))

    @property
    def head_size_padded(self) -> int:
        return max(16, next_pow2(self.head_size))

    @property
    def units(self) -> int:
        """Programs without splitting: one per (sequence, KV head)."""
        return self.num_seqs * self.num_kv_heads

    @property
    def wave_slots(self) -> int:
        return self.num_sms * self.programs_per_sm

    @property
    def programs(self) -> int:
        return self.units * self.num_splits

    @property
    def merge_programs(self) -> int:
        """Programs of the merge kernel (one per (sequence, query head)); 0 when unsplit."""
        if self.num_splits == 1 or self.fused_merge:
            return 0
        return self.num_seqs * self.num_q_heads

    @property
    def kernel(self) -> str:
        if self.num_splits == 1:
            return "paged_decode (one pass, writes the output directly)"
        if self.fused_merge:
            return (f"paged_decode split-KV ({self.num_splits} splits), merged by each "
                    "group's last split (one launch)")
        return f"paged_decode split-KV ({self.num_splits} splits) + merge"

    @property
    def efficiency_unsplit(self) -> float:
        return wave_efficiency(self.units, self.num_sms * PROGRAMS_PER_SM)

    @property
    def efficiency(self) -> float:
        return wave_efficiency(self.programs, self.wave_slots)

    def __str__(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        if self.kv_dtype is not None:
            dtype += f" queries over a {str(self.kv_dtype).replace('torch.', '')} cache"
        g = self.group_size
        heads = (f"{self.num_q_heads} q heads / {self.num_kv_heads} kv heads"
                 + (f" (GQA {g}:1)" if g > 1 else " (MHA)"))
        t = self.tiles
        seqs = f"{self.num_seqs} seq" + ("s" if self.num_seqs != 1 else "")
        lines = [
            f"paged decode: {seqs} x {heads}, head_size {self.head_size}, {dtype}, "
            f"block_size {self.block_size}, context <= {self.max_context_len}"
            + (f", window of {self.window_left + 1} keys" if self.window_left >= 0 else ""),
            f"  kernel:   {self.kernel}",
            f"  tiles:    {g} q heads padded to {self.block_h} rows x {t.block_n} kv tokens x "
            f"{self.head_size_padded} dims; {t.num_warps} warps, {t.num_stages} stages"
            + (f", at most {t.maxnreg} registers a thread" if t.maxnreg is not None else ""),
            f"  programs: {self.programs} = {seqs} x {self.num_kv_heads} kv heads"
            f" x {self.num_splits} split{'s' if self.num_splits != 1 else ''}, on "
            f"{self.wave_slots} slots ({self.num_sms} SMs x {self.programs_per_sm})"
            + (f"; merge: {self.merge_programs}" if self.merge_programs else ""),
        ]
        unsplit = (f"{self.units} programs unsplit fill {self.efficiency_unsplit:.0%} "
                   "of their last wave")
        if self.split_reason == "forced":
            why = f"num_splits={self.num_splits} was forced"
        elif self.split_reason == "fp8 programs":
            why = (f"{self.units} programs of short sequences over an fp8 cache, taken "
                   f"longest first, are under {FP8_SPLIT_BELOW} per SM: split toward "
                   f"{FP8_PROGRAMS_PER_SM} per SM")
        elif self.split_reason == "fp8 short":
            why = (f"over an fp8 cache, sequences of at most {FP8_SHORT_TILES} tiles "
                   f"({self.max_context_len} tokens) split in 2 (shorter programs even out "
                   "the SMs' load)")
        elif self.split_reason == "enough programs":
            why = (f"{self.units} programs >= 80% of {self.wave_slots} slots: no split "
                   "needed (FlashAttention's rule)")
            if (self.ordered and self.fp16_dots and window_kv_tiles(
                    self.max_context_len, self.tiles.block_n, self.window_left)
                    <= FP8_SHORT_TILES):
                why += "; sequences taken longest first even out short fp8 programs"
        else:
            why = (f"{unsplit}; FlashAttention's split heuristic over "
                   f"{self.heuristic_kv_tiles} kv tiles chose {self.heuristic_splits} split"
                   + ("s" if self.heuristic_splits != 1 else ""))
            if self.heuristic_splits != self.num_splits:
                why += (f", balanced to {self.num_splits} in as many waves (each split "
                        f"{cdiv(self.heuristic_kv_tiles, self.num_splits)} tiles instead of "
                        f"{cdiv(self.heuristic_kv_tiles, self.heuristic_splits)})")
            why += f"; {self.efficiency:.0%} of the last wave"
        lines.append(f"  why:      {why}")
        occupancy = dict(FP8_OCCUPANCY).get(self.tiles)
        if self.fp16_dots and occupancy is not None:
            lines.append(
                f"  fp8:      {occupancy} programs an SM (registers and stages chosen so that "
                f"the last wave is fullest: "
                f"{wave_efficiency(self.programs, occupancy * self.num_sms):.0%})")
        return "\n".join(lines)


@functools.lru_cache(maxsize=4096)
def plan_decode(num_seqs: int, num_q_heads: int, num_kv_heads: int, head_size: int,
                max_context_len: int, block_size: int, dtype: torch.dtype, num_sms: int,
                num_splits: int | None = None, max_splits: int = MAX_SPLITS,
                on_gpu: bool = True, tiles: DecodeTiles | None = None, *,
                kv_dtype: torch.dtype | None = None, window_left: int = -1,
                fused_merge: bool = False, ordered: bool = False) -> DecodePlan:
    """Plan one decode launch (pure; cached). The single place tiles and splits are chosen.

    num_splits: forced split count (1..MAX_SPLITS), or None for the heuristic.
    max_splits: cap for the heuristic (a caller's workspace may hold fewer splits).
    on_gpu: pick GPU tiles (else small interpreter tiles); ``tiles`` overrides either.
    kv_dtype: the cache's dtype when it differs from the query's (an fp8 cache), else None.
    window_left: a sliding window's left side (-1: none); the heuristic then counts only the
        tiles a window can touch.
    fused_merge: if the plan splits, merge inside the decode kernel (see :data:`FUSED_MERGE`).
    ordered: the launch takes its sequences longest first (``seq_order``; see
        :data:`FP8_ORDERED_UNSPLIT`).
    """
    if num_splits is not None and not (is_int(num_splits) and 1 <= num_splits <= MAX_SPLITS):
        raise ValueError(f"num_splits: expected an int in 1..{MAX_SPLITS} or None, "
                         f"got {num_splits!r}")
    units = num_seqs * num_kv_heads
    per_sm = PROGRAMS_PER_SM
    slots = num_sms * per_sm
    chosen = n_tiles = None
    tiles_given = tiles is not None
    if num_splits is not None:
        splits, reason = num_splits, "forced"
    else:
        # Count KV tiles with the tiles a split launch would use; keep them if it splits.
        split_tiles = tiles or default_tiles(head_size, dtype, on_gpu, True,
                                             block_size=block_size, kv_dtype=kv_dtype)
        n_tiles = max(1, window_kv_tiles(max_context_len, split_tiles.block_n, window_left))
        cap = max(1, min(max_splits, MAX_SPLITS, n_tiles))
        chosen = splits = num_splits_heuristic(max(units, 1), slots, n_tiles, cap)
        # The heuristic's first rule: >= 80% of a wave needs no split.
        reason = "enough programs" if units >= 0.8 * slots else "heuristic"
        if splits > 1:
            splits = balance_splits(splits, max(units, 1), slots, n_tiles, cap)
        if splits > 1 and kv_dtype is None and cdiv(n_tiles, splits) > SHORT_SPLIT_TILES:
            # Split programs that still run long: choose for the split tiles' wave.
            per_sm = SPLIT_PROGRAMS_PER_SM
            slots = num_sms * per_sm
            chosen = num_splits_heuristic(max(units, 1), slots, n_tiles, cap)
            splits = balance_splits(chosen, max(units, 1), slots, n_tiles, cap)
        elif (reason == "enough programs" and kv_dtype is not None and kv_dtype.itemsize == 1
              and on_gpu and tiles is None):
            # Short fp8 programs start and end unevenly: split them in two, or (taken
            # longest first, few a SM) toward FP8_PROGRAMS_PER_SM. Either split keeps the
            # unsplit launch's tiles.
            unsplit = default_tiles(head_size, dtype, on_gpu, False, block_size=block_size,
                                    kv_dtype=kv_dtype)
            fp8_tiles = max(1, window_kv_tiles(max_context_len, unsplit.block_n, window_left))
            cap = max(1, min(max_splits, MAX_SPLITS))
            short = 1 < fp8_tiles <= FP8_SHORT_TILES and cap > 1
            if ordered:
                short = short and (FP8_SPLIT_BELOW * num_sms <= units
                                   < FP8_ORDERED_UNSPLIT * num_sms)
            if short:
                chosen, splits, reason = 2, 2, "fp8 short"
            elif units < FP8_SPLIT_BELOW * num_sms and fp8_tiles <= FP8_SHORT_TILES:
                chosen = splits = min(fp8_tiles, cap,
                                      max(1, round(FP8_PROGRAMS_PER_SM * num_sms / units)))
                if splits > 1:
                    reason = "fp8 programs"
            if splits > 1:
                tiles, n_tiles = unsplit, fp8_tiles
    if (not tiles_given and on_gpu and kv_dtype is not None and kv_dtype.itemsize == 1
            and dtype in (torch.float16, torch.bfloat16) and head_size == 128):
        # The fp8 tiles with the registers and stages that fill the last wave best (counted
        # at head_size 128).
        tiles = fp8_occupancy_tiles(max(units, 1) * splits, num_sms)
    tiles = tiles or default_tiles(head_size, dtype, on_gpu, splits > 1, block_size=block_size,
                                   kv_dtype=kv_dtype)
    return DecodePlan(num_seqs, num_q_heads, num_kv_heads, head_size, block_size, dtype,
                      max_context_len, tiles, num_sms, splits, reason, chosen, n_tiles,
                      kv_dtype, window_left, fused_merge and splits > 1, ordered, per_sm)


def window_kv_tiles(max_context_len: int, block_n: int, window_left: int = -1) -> int:
    """KV tiles of ``block_n`` tokens one decode query reads at most: those of the context,
    or with a left window the most that ``window_left + 1`` keys starting anywhere can touch."""
    full = cdiv(max_context_len, block_n)
    if window_left < 0:
        return full
    return min(full, cdiv(window_left + block_n, block_n))


def explain_decode(num_seqs: int, num_q_heads: int, num_kv_heads: int, head_size: int,
                   max_context_len: int, block_size: int = 16,
                   dtype: torch.dtype = torch.bfloat16,
                   device: torch.device | str | None = None, *,
                   window_size: tuple[int, int] = (-1, -1),
                   kv_cache_dtype: torch.dtype | None = None,
                   max_splits: int | None = None, ordered: bool = False) -> DecodePlan:
    """Which decode kernel runs for these sizes, with which tiles and splits, and why.

    ``device``: the CUDA device whose SM count to plan for; None uses the current CUDA device
    if there is one, else assumes an H100's 132 SMs. ``window_size``: the layer's sliding
    window (as ``paged_decode``'s); a left window plans for the tiles it can touch.
    ``kv_cache_dtype``: the cache's dtype when it is not ``dtype`` (``torch.float8_e4m3fn``).
    ``max_splits``: the splits a caller's workspace holds (see ``decode.workspace_size``);
    None plans a call without a workspace (its merge as :data:`FUSED_MERGE` says).
    ``ordered``: the call passes ``seq_order`` (sequences taken longest first). Returns a
    :class:`DecodePlan`; print it for a short explanation. ``paged_decode(..., explain=True)``
    logs the plan of the call itself.
    """
    num_seqs = positive_int("num_seqs", num_seqs)
    num_q_heads = positive_int("num_q_heads", num_q_heads)
    num_kv_heads = positive_int("num_kv_heads", num_kv_heads)
    head_size = positive_int("head_size", head_size)
    block_size = positive_int("block_size", block_size)
    max_context_len = non_negative_int("max_context_len", max_context_len)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads: expected a multiple of num_kv_heads={num_kv_heads}, "
                         f"got {num_q_heads}")
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"dtype: expected torch.float16, bfloat16 or float32, got {dtype}")
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device) if device is not None else None
    window = check_window(window_size)
    if kv_cache_dtype is not None and kv_cache_dtype not in (dtype, FP8_DTYPE):
        raise ValueError(f"kv_cache_dtype: expected None, {dtype} or {FP8_DTYPE}, "
                         f"got {kv_cache_dtype}")
    if max_splits is not None:
        max_splits = positive_int("max_splits", max_splits)
    return plan_decode(num_seqs, num_q_heads, num_kv_heads, head_size, max_context_len,
                       block_size, dtype, num_sms_of(device),
                       max_splits=min(max_splits or MAX_SPLITS, MAX_SPLITS),
                       window_left=window[0],
                       kv_dtype=None if kv_cache_dtype in (None, dtype) else kv_cache_dtype,
                       fused_merge=FUSED_MERGE and max_splits is None,
                       ordered=check_bool("ordered", ordered))


# DecodeTiles, default_tiles, FP8_TILES and MAX_BLOCK_N live in .decode_tiles; re-exported
# here, where the plan that uses them is.
__all__ = ["DecodePlan", "DecodeTiles", "plan_decode", "explain_decode", "default_tiles",
           "balance_splits", "window_kv_tiles", "FP8_TILES", "MAX_BLOCK_N",
           "num_sms_of", "FUSED_MERGE", "MAX_SPLITS", "PROGRAMS_PER_SM",
           "SPLIT_PROGRAMS_PER_SM", "SHORT_SPLIT_TILES"]
