"""Argument checks shared by every backend of the paged attention ops.

Shape, dtype and device checks cost nothing on the device and run on every call, for every
backend. Checks of *values* (lengths against the table's capacity, block ids against the pool)
need the tensors on the host, so they run only in :func:`check_paged_values`, which the torch
backend calls; the Triton backend skips it so a call can be captured in a CUDA graph.

Every failure is a ``ValueError`` that names the argument, what was expected and what arrived.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..core.args import arg_error, cdiv, is_int, is_number, next_pow2
from .kv_quant import FP8_DTYPE

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class PagedShapes:
    """Sizes read off the arguments of a paged attention call (validated)."""

    num_seqs: int
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    num_blocks: int
    block_size: int
    max_blocks_per_seq: int
    scale: float

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 for MHA, num_q_heads for MQA)."""
        return self.num_q_heads // self.num_kv_heads


def _describe(t: torch.Tensor) -> str:
    return f"{t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"


def check_launch_config(config: object, tile_names: tuple[str, ...], max_stages: int) -> None:
    """Check a Triton launch config: each of ``tile_names`` a power of two >= 16, ``num_warps``
    in 1, 2, 4, 8, 16 and ``num_stages`` an int in ``1..max_stages``."""
    for name in tile_names:
        value = getattr(config, name)
        if not (is_int(value) and value >= 16 and value == next_pow2(value)):
            raise arg_error(name, "a power of two >= 16", repr(value))
    if not (is_int(config.num_warps) and config.num_warps in (1, 2, 4, 8, 16)):
        raise arg_error("num_warps", "1, 2, 4, 8 or 16", repr(config.num_warps))
    if not (is_int(config.num_stages) and 1 <= config.num_stages <= max_stages):
        raise arg_error("num_stages", f"an int in 1..{max_stages}", repr(config.num_stages))


def check_tensor(name: str, t: object, *, ndim: int, dtypes: tuple[torch.dtype, ...],
                 device: torch.device | None = None, device_of: str = "the query") -> torch.Tensor:
    """Check rank, dtype and device of one tensor argument; return it. ``device_of`` names
    the argument whose device ``device`` is, for the message."""
    if not isinstance(t, torch.Tensor):
        raise arg_error(name, "a torch.Tensor", type(t).__name__)
    if t.dim() != ndim:
        raise arg_error(name, f"a {ndim}-D tensor", _describe(t))
    if t.dtype not in dtypes:
        raise arg_error(name, "dtype " + " or ".join(str(d) for d in dtypes), _describe(t))
    if device is not None and t.device != device:
        raise arg_error(name, f"a tensor on {device} ({device_of}'s device)", _describe(t))
    return t


def check_index_vector(name: str, t: object, *, dtypes: tuple[torch.dtype, ...],
                       device: torch.device | None = None) -> torch.Tensor:
    """Check a 1-D integer argument that the kernels index with stride 1 (lengths, offsets,
    slots, an order): rank, dtype, device and a contiguous layout; return it."""
    check_tensor(name, t, ndim=1, dtypes=dtypes, device=device)
    if t.shape[0] > 1 and t.stride(0) != 1:
        raise arg_error(name, "a contiguous 1-D tensor (stride 1)", f"stride {t.stride(0)}")
    return t


def check_seq_order(seq_order: object, num_seqs: int, device: torch.device) -> None:
    """``seq_order``: None, or int32 ``[num_seqs]`` on ``device`` (its values are checked by
    :func:`check_seq_order_values`)."""
    if seq_order is None:
        return
    check_index_vector("seq_order", seq_order, dtypes=(torch.int32,), device=device)
    if seq_order.shape[0] != num_seqs:
        raise arg_error("seq_order", f"shape ({num_seqs},) (num_seqs)", tuple(seq_order.shape))


def check_seq_order_values(seq_order: torch.Tensor) -> None:
    """``seq_order`` holds each of ``0 .. num_seqs - 1`` once (a host sync on CUDA)."""
    values = seq_order.detach().to("cpu", torch.int64)
    seen = torch.zeros(values.shape[0], dtype=torch.int64)
    in_range = (values >= 0) & (values < values.shape[0])
    seen.index_add_(0, values[in_range], torch.ones_like(values[in_range]))
    if not in_range.all() or (seen != 1).any():
        raise arg_error("seq_order", f"a permutation of 0..{values.shape[0] - 1}",
                        values.tolist()[:16])


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    """The kernels index a tensor's last dim with stride 1; other dims may have any strides."""
    if t.stride(-1) != 1:
        raise arg_error(name, "a contiguous last dimension (stride 1)", f"strides {t.stride()}")


def check_cache_pair(key_cache: object, value_cache: object, dtype: torch.dtype,
                     device: torch.device) -> tuple[int, int, int, int]:
    """Check the paged K/V caches; return (num_blocks, block_size, num_kv_heads, head_size).

    Caches are ``[num_blocks, block_size, num_kv_heads, head_size]`` with any strides on the
    first three dims and a contiguous last dim, on the query's device, both in the query's
    dtype or both in ``torch.float8_e4m3fn`` (an fp8 cache, see :mod:`.kv_quant`).
    """
    check_tensor("key_cache", key_cache, ndim=4, dtypes=(dtype, FP8_DTYPE), device=device)
    check_tensor("value_cache", value_cache, ndim=4, dtypes=(key_cache.dtype,), device=device)
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        check_last_dim_contiguous(name, c)
    if key_cache.shape != value_cache.shape:
        raise arg_error("value_cache", f"the shape of key_cache {tuple(key_cache.shape)}",
                        tuple(value_cache.shape))
    num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
    if min(num_blocks, block_size, num_kv_heads, head_size) < 1:
        raise arg_error("key_cache", "non-empty dimensions", tuple(key_cache.shape))
    return num_blocks, block_size, num_kv_heads, head_size


def check_heads(num_q_heads: int, num_kv_heads: int, q_head_size: int, kv_head_size: int) -> None:
    if kv_head_size != q_head_size:
        raise arg_error("key_cache", f"head_size {q_head_size} (the query's last dim)",
                        kv_head_size)
    if num_q_heads % num_kv_heads != 0:
        raise arg_error("query", f"num_q_heads divisible by num_kv_heads={num_kv_heads}",
                        f"num_q_heads={num_q_heads}")


def check_scale(scale: float | None, head_size: int, name: str = "scale") -> float:
    """The softmax scale: ``scale`` (a finite number > 0), or ``head_size ** -0.5`` for None."""
    if scale is None:
        return head_size ** -0.5
    if not is_number(scale) or not 0 < scale < math.inf:
        raise arg_error(name, "a positive float or None", repr(scale))
    return float(scale)


def check_out(out: torch.Tensor | None, like: torch.Tensor) -> None:
    """Check an optional ``out`` tensor: None, or ``like``'s shape, dtype and device (``like``
    is the query, ``[num_tokens, num_q_heads, head_size]``)."""
    if out is None:
        return
    check_tensor("out", out, ndim=like.dim(), dtypes=(like.dtype,), device=like.device)
    if out.shape != like.shape:
        raise arg_error("out", f"shape {tuple(like.shape)} (the query's)", tuple(out.shape))


def _check_query_and_caches(query, key_cache, value_cache) -> tuple[int, int, int, int, int]:
    """Checks common to decode and prefill; returns
    (num_q_heads, head_size, num_blocks, block_size, num_kv_heads)."""
    check_tensor("query", query, ndim=3, dtypes=FLOAT_DTYPES)
    check_last_dim_contiguous("query", query)
    _, num_q_heads, head_size = query.shape
    num_blocks, block_size, num_kv_heads, kv_head_size = check_cache_pair(
        key_cache, value_cache, query.dtype, query.device)
    check_heads(num_q_heads, num_kv_heads, head_size, kv_head_size)
    return num_q_heads, head_size, num_blocks, block_size, num_kv_heads


def _check_table_rows(block_tables, num_seqs: int, source: str, device: torch.device) -> None:
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,), device=device)
    if block_tables.shape[0] != num_seqs:
        raise arg_error("block_tables", f"{num_seqs} rows (num_seqs of {source})",
                        f"shape {tuple(block_tables.shape)}")
    check_last_dim_contiguous("block_tables", block_tables)


def check_paged_decode_args(query, key_cache, value_cache, block_tables, context_lens,
                            scale, out) -> PagedShapes:
    """Validate a ``paged_decode`` call (shapes, dtypes, devices) and return its sizes."""
    num_q_heads, head_size, num_blocks, block_size, num_kv_heads = _check_query_and_caches(
        query, key_cache, value_cache)
    num_seqs = query.shape[0]
    _check_table_rows(block_tables, num_seqs, "the query", query.device)
    check_index_vector("context_lens", context_lens, dtypes=(torch.int32,), device=query.device)
    if context_lens.shape[0] != num_seqs:
        raise arg_error("context_lens", f"shape ({num_seqs},)", tuple(context_lens.shape))
    check_out(out, query)
    return PagedShapes(num_seqs, num_q_heads, num_kv_heads, head_size, num_blocks, block_size,
                       block_tables.shape[1], check_scale(scale, head_size))


def check_paged_prefill_args(query, key_cache, value_cache, block_tables, cu_seqlens_q,
                             context_lens, scale, out) -> PagedShapes:
    """Validate a ``paged_prefill`` call (shapes, dtypes, devices) and return its sizes.

    ``num_seqs`` is taken from ``context_lens``; ``query`` is ``[total_q, num_q_heads, head_size]``.
    """
    num_q_heads, head_size, num_blocks, block_size, num_kv_heads = _check_query_and_caches(
        query, key_cache, value_cache)
    check_index_vector("context_lens", context_lens, dtypes=(torch.int32,), device=query.device)
    num_seqs = context_lens.shape[0]
    check_index_vector("cu_seqlens_q", cu_seqlens_q, dtypes=(torch.int32,), device=query.device)
    if cu_seqlens_q.shape[0] != num_seqs + 1:
        raise arg_error("cu_seqlens_q", f"shape ({num_seqs + 1},) (num_seqs + 1)",
                        tuple(cu_seqlens_q.shape))
    _check_table_rows(block_tables, num_seqs, "context_lens", query.device)
    check_out(out, query)
    return PagedShapes(num_seqs, num_q_heads, num_kv_heads, head_size, num_blocks, block_size,
                       block_tables.shape[1], check_scale(scale, head_size))


def check_cu_seqlens(name: str, cu_seqlens: torch.Tensor, total: int, total_name: str, *,
                     exact: bool = True) -> torch.Tensor:
    """Check the values of cumulative lengths (a host sync on CUDA): they start at 0, never
    decrease and end at ``total`` (``exact``) or at most at ``total``. Returns the lengths,
    int64 ``[num_seqs]`` on the host."""
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    lens = cu[1:] - cu[:-1]
    end_ok = int(cu[-1]) == total if exact else int(cu[-1]) <= total
    if int(cu[0]) != 0 or (lens < 0).any() or not end_ok:
        end = f"{total_name}={total}" if exact else f"at most {total_name}={total}"
        raise arg_error(name, f"a non-decreasing sequence from 0 to {end}", cu.tolist())
    return lens


def check_paged_values(shapes: PagedShapes, block_tables: torch.Tensor,
                       context_lens: torch.Tensor, cu_seqlens_q: torch.Tensor | None = None,
                       total_q: int | None = None, *, causal: bool = True,
                       names: tuple[str, str, str] = ("block_tables", "context_lens",
                                                      "cu_seqlens_q")) -> None:
    """Check the *values* of lengths and tables (a host sync on CUDA).

    - ``0 <= context_lens[i] <= max_blocks_per_seq * block_size``;
    - every table entry a sequence uses (the first ``ceil(context_lens[i] / block_size)``) is a
      block id in ``[0, num_blocks)``; entries past a sequence's length are never read;
    - with ``cu_seqlens_q``: it starts at 0, never decreases, ends at ``total_q``, and, when
      ``causal``, ``q_len_i <= context_lens[i]`` (the queries are the last tokens; a
      non-causal query sees all its keys wherever it sits, so any count of them is valid).

    ``names``: what the errors call ``block_tables``, ``context_lens`` and ``cu_seqlens_q``
    (an op whose arguments have other names passes its own).
    """
    table_name, lens_name, cu_name = names
    lens = context_lens.detach().to("cpu", torch.int64)
    if (lens < 0).any():
        i = int(torch.nonzero(lens < 0)[0])
        raise arg_error(lens_name, "non-negative lengths", f"{lens_name}[{i}]={int(lens[i])}")
    capacity = shapes.max_blocks_per_seq * shapes.block_size
    if (lens > capacity).any():
        i = int(torch.nonzero(lens > capacity)[0])
        raise arg_error(lens_name,
                        f"lengths <= max_blocks_per_seq * block_size = {capacity}",
                        f"{lens_name}[{i}]={int(lens[i])}")
    if shapes.max_blocks_per_seq > 0 and lens.numel() > 0:
        table = block_tables.detach().to("cpu", torch.int64)
        used_blocks = cdiv(lens, shapes.block_size)
        used = torch.arange(shapes.max_blocks_per_seq) < used_blocks[:, None]
        bad = used & ((table < 0) | (table >= shapes.num_blocks))
        if bad.any():
            i, j = (int(x) for x in torch.nonzero(bad)[0])
            raise arg_error(table_name,
                            f"block ids in [0, {shapes.num_blocks}) for used entries",
                            f"{table_name}[{i}, {j}]={int(table[i, j])}")
    if cu_seqlens_q is not None:
        q_lens = check_cu_seqlens(cu_name, cu_seqlens_q, total_q, "total_q")
        if causal and (q_lens > lens).any():
            i = int(torch.nonzero(q_lens > lens)[0])
            raise arg_error(cu_name,
                            "q_len <= context_lens for every sequence "
                            "(queries are the last tokens)",
                            f"q_len={int(q_lens[i])} > {lens_name}[{i}]={int(lens[i])}")
