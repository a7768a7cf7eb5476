"""How many splits of the KV sequence keep the GPU busy: FlashAttention's split-KV heuristic.

A decode launch has ``batch_nheads_mblocks`` independent work units (sequences x heads x query
tiles). When they cannot fill the SMs, splitting each sequence's keys into ``s`` chunks gives
``s`` times more units, at the price of writing partial results and merging them. A launch runs
in *waves* of ``num_sms`` units; its efficiency is ``waves / ceil(waves)`` (how full the last
wave is). The heuristic finds the best efficiency over the eligible split counts, then returns
the *smallest* split count within 85% of it, since every extra split costs HBM traffic.

Example (FlashAttention's own): 48 units on 108 SMs. 1 split: 0.44 waves, efficiency 0.44;
2 splits: 0.89; 3 splits: 1.33 waves in 2, 0.67; ... 9 splits: exactly 4 waves, 1.0. The best is
1.0, and 2 splits already reach 0.89 >= 0.85, so the answer is 2.

FlashAttention computes this in C++ float (``0.8f * num_SMs``, ``float n_waves``) and compares
against ``0.85 * max_efficiency`` in double; the arithmetic below is numpy float32 where theirs is
float, so the result is the same bit for bit, edge cases included.
"""

from __future__ import annotations

import math

import numpy as np

from ..core.args import cdiv, positive_int

_INT32_MAX = 2**31 - 1


def _c_int(name: str, value: object) -> int:
    v = positive_int(name, value)
    if v > _INT32_MAX:
        raise ValueError(f"{name}: expected a positive int (at most {_INT32_MAX}, a C int), "
                         f"got {v}")
    return v


def wave_efficiency(programs: int, wave_slots: int) -> float:
    """Fraction of the last wave's slots that do work: ``w / ceil(w)``, ``w = programs/slots``."""
    waves = programs / wave_slots
    return waves / math.ceil(waves) if programs > 0 else 0.0


def num_splits_heuristic(batch_nheads_mblocks: int, num_sms: int, num_n_blocks: int,
                         max_splits: int) -> int:
    """FlashAttention's ``num_splits_heuristic``: the number of KV splits for a decode launch.

    Args:
        batch_nheads_mblocks: independent work units without splitting
            (``batch * num_heads * num_m_blocks`` in FlashAttention).
        num_sms: units that run at once (FlashAttention passes ``2 * multiProcessorCount``:
            two 128-thread blocks per SM).
        num_n_blocks: KV tiles of the longest sequence, ``ceil(max_seqlen_k / block_n)``; a split
            holds at least one.
        max_splits: upper bound on the answer (FlashAttention passes 128).

    Returns:
        The split count, in ``1 .. min(max_splits, num_sms, num_n_blocks)``; 1 when the units
        already fill 80% of ``num_sms``.

    Raises:
        ValueError: an argument that is not a positive int within C int range.
    """
    units = _c_int("batch_nheads_mblocks", batch_nheads_mblocks)
    sms = _c_int("num_sms", num_sms)
    n_blocks = _c_int("num_n_blocks", num_n_blocks)
    max_splits = _c_int("max_splits", max_splits)

    f32 = np.float32
    # C++ `units >= 0.8f * num_SMs`: both sides are float.
    if f32(units) >= f32(0.8) * f32(sms):
        return 1
    max_splits = min(max_splits, sms, n_blocks)

    def eligible(splits: int) -> bool:
        # 12 splits of 64 tiles are 11 splits of 6 tiles (and one of -2): the same as 11, skip.
        return splits == 1 or cdiv(n_blocks, splits) != cdiv(n_blocks, splits - 1)

    efficiency: dict[int, np.float32] = {}
    max_efficiency = f32(0.0)
    for splits in range(1, max_splits + 1):
        if eligible(splits):
            # units * splits < 0.8 * sms * sms: an exact int before the float conversion, as in C++
            # for any launch whose product fits a C int.
            n_waves = f32(units * splits) / f32(sms)
            eff = n_waves / f32(math.ceil(n_waves))
            max_efficiency = max(max_efficiency, eff)
            efficiency[splits] = eff
    # C++ `efficiency[i] >= 0.85 * max_efficiency`: the literal 0.85 is a double, so this one
    # comparison happens in double precision.
    threshold = 0.85 * float(max_efficiency)
    for splits in range(1, max_splits + 1):
        if splits in efficiency and float(efficiency[splits]) >= threshold:
            return splits
    return 1
