"""Triton kernel of :func:`~.sample.sample_tokens`: temperature sampling by the exponential race
in one pass over the logits.

Each program reads one slice of one row's logits, draws its noise in registers (Philox,
``tl.rand4x``, keyed by the launch's seed plus the row) and keeps the slice's best
``logit / T - log(E)`` (``E = -log(U)``, an Exp(1) draw; the plain logit for a greedy row); a
second pass over the few slices per row picks the winner. A row with no finite candidate (all
``-inf``) or with a NaN logit reports a slice best of ``-inf`` / NaN, which the launcher turns
into the row's "invalid" flag (the ids stay in range either way). Eager PyTorch does
the same in seven passes over a float32 ``[rows, vocab]`` tensor (divide, draw, clamp, log,
subtract, argmax, plus the noise's allocation); at 256 rows of a 151,936-token vocabulary that
is ~1.7 GB of memory traffic a step against this kernel's one read of the logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.args import cdiv
from .launch import launch
from .sample import nothing_to_sample

BLOCK = 2048  # vocabulary entries per loop step of a program


# Bounds of an Exp(1) draw: U may round to 1 (E = 0) or be exactly 0 (E = inf, a score of -inf
# that would lose even to a row's only allowed token). Draws of a uniform > 0 lie inside.
E_MIN = tl.constexpr(1e-20)
E_MAX = tl.constexpr(1e30)


@triton.jit
def _race(row_ptr, ids, end, u, greedy, inv_t, best, best_ids, nan):
    """Fold tokens ``ids`` (< ``end``) with uniforms ``u`` into each lane's best score so far,
    its token id and whether the lane met a NaN logit (all ``[QUARTER]``)."""
    in_row = ids < end
    x = tl.load(row_ptr + ids, mask=in_row, other=float("-inf")).to(tl.float32)
    e = tl.minimum(tl.maximum(-tl.log(u), E_MIN), E_MAX)   # E = -log(U) ~ Exp(1)
    score = tl.where(greedy, x, x * inv_t - tl.log(e))
    score = tl.where(in_row, score, float("-inf"))
    better = score > best  # strictly: the earlier (smaller) id keeps a tie; never a NaN
    return (tl.where(better, score, best), tl.where(better, ids, best_ids),
            nan | (x != x))


@triton.jit
def _sample_slices_kernel(
    logits_ptr, temperatures_ptr, seed_ptr, best_ptr, best_ids_ptr,
    vocab_size, slice_len, stride_row, num_slices,
    BLOCK: tl.constexpr,
):
    """Grid ``(rows, num_slices)``: program (row, s) scans tokens ``[s * slice_len, (s + 1) *
    slice_len)`` of its row and writes its best score and that score's first token id to
    ``best[row, s]`` / ``best_ids[row, s]`` (float32 / int32 ``[rows, num_slices]``); the best
    is NaN when the slice holds a NaN logit, -inf when it holds no finite candidate.

    Each loop step covers BLOCK tokens as four quarters: one Philox call (``tl.rand4x``, keyed
    by the seed plus the row, counted by ``start / 4 + lane``) gives the four quarters'
    uniforms, a quarter of the generator's work of one call per token."""
    QUARTER: tl.constexpr = BLOCK // 4
    row = tl.program_id(0)
    part = tl.program_id(1)
    temperature = tl.load(temperatures_ptr + row)
    greedy = temperature == 0.0
    inv_t = 1.0 / tl.where(greedy, 1.0, temperature)
    # One Philox key per row: its noise never depends on the other rows or slices.
    seed = tl.load(seed_ptr) + row
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    begin = part * slice_len
    end = tl.minimum(begin + slice_len, vocab_size)
    lanes = tl.arange(0, QUARTER)                                  # [QUARTER]
    best = tl.full([QUARTER], float("-inf"), tl.float32)          # [QUARTER]
    best_ids = tl.zeros([QUARTER], tl.int32)                       # [QUARTER]
    nan = tl.zeros([QUARTER], tl.int1)                             # [QUARTER]
    for start in range(begin, end, BLOCK):  # begin and BLOCK are multiples of 4
        u0, u1, u2, u3 = tl.rand4x(seed, start // 4 + lanes)       # 4 x [QUARTER] in [0, 1)
        best, best_ids, nan = _race(row_ptr, start + lanes, end, u0, greedy, inv_t, best,
                                    best_ids, nan)
        best, best_ids, nan = _race(row_ptr, start + QUARTER + lanes, end, u1, greedy, inv_t,
                                    best, best_ids, nan)
        best, best_ids, nan = _race(row_ptr, start + 2 * QUARTER + lanes, end, u2, greedy,
                                    inv_t, best, best_ids, nan)
        best, best_ids, nan = _race(row_ptr, start + 3 * QUARTER + lanes, end, u3, greedy,
                                    inv_t, best, best_ids, nan)
    top = tl.max(best, axis=0)
    # The smallest id among the lanes holding the top score (argmax's first-index rule); a
    # slice of -inf only keeps its lanes' ids, which are in range.
    first = tl.min(tl.where(best == top, best_ids, 2147483647), axis=0)
    has_nan = tl.max(nan.to(tl.int32), axis=0) > 0
    tl.store(best_ptr + row * num_slices + part, tl.where(has_nan, float("nan"), top))
    tl.store(best_ids_ptr + row * num_slices + part, first)


def triton_sample_tokens(logits: torch.Tensor, temperatures: torch.Tensor,
                         seed: torch.Tensor, num_sms: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: ``[rows, vocab]`` fp32/fp16/bf16, last dim contiguous; temperatures: float32
    ``[rows]`` (0: greedy); seed: int64 ``[1]`` on the device. Returns the int64 ``[rows]``
    ids (each in ``[0, vocab)``) and the bool ``[rows]`` flags of the rows that had nothing to
    sample (every logit -inf, or a NaN among them)."""
    rows, vocab = logits.shape
    block = min(BLOCK, max(16, triton.next_power_of_2(vocab)))
    # Enough programs to fill the GPU twice over, each scanning at least one block.
    slices = max(1, min(cdiv(vocab, block), cdiv(2 * num_sms, max(rows, 1))))
    slice_len = cdiv(cdiv(vocab, slices), block) * block
    slices = cdiv(vocab, slice_len)
    best = torch.empty(rows, slices, dtype=torch.float32, device=logits.device)
    best_ids = torch.empty(rows, slices, dtype=torch.int32, device=logits.device)
    launch(_sample_slices_kernel, (rows, slices), (
        logits, temperatures, seed, best, best_ids, vocab, slice_len, logits.stride(0), slices),
        dict(BLOCK=block, num_warps=8 if block == BLOCK else 4))
    if slices == 1:
        return best_ids[:, 0].long(), nothing_to_sample(best[:, 0])
    # amax and argmax both take a NaN slice: the flag is set, the id still one of the row's.
    invalid = nothing_to_sample(best.amax(dim=1))
    return best_ids.gather(1, best.argmax(dim=1, keepdim=True))[:, 0].long(), invalid


__all__ = ["triton_sample_tokens"]
