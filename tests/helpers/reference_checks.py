"""Kernel results against the float32 gather reference, with tolerances by dtype.

Use from any test (tests/ is on sys.path through tests/conftest.py)::

    from helpers.reference_checks import assert_decode_matches_reference, run_and_compare
"""

from __future__ import annotations

import torch

from helpers.paged_batch import PagedBatch
from mini_paged_attn.ops import reference
from mini_paged_attn.ops.checks import check_paged_prefill_args
from mini_paged_attn.ops.dispatch import paged_prefill
from mini_paged_attn.ops.prefill import triton_paged_prefill
from mini_paged_attn.ops.prefill_plan import PrefillConfig

# Max |kernel - reference| by dtype, for the decode and prefill kernels alike.
TOL = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def assert_decode_matches_reference(batch: PagedBatch, out: torch.Tensor,
                                    lse: torch.Tensor | None, scale: float | None = None,
                                    tol: float | None = None) -> None:
    """Compare a decode result with the float32 gather reference (tolerance by dtype)."""
    scale = scale if scale is not None else batch.query.shape[-1] ** -0.5
    ref_out, ref_lse = reference.paged_decode_gather(*batch.decode_args, scale=scale)
    tol = tol if tol is not None else TOL[batch.query.dtype]
    torch.testing.assert_close(out.float(), ref_out, atol=tol, rtol=tol)
    if lse is not None:
        torch.testing.assert_close(lse, ref_lse, atol=tol, rtol=tol)


def run_and_compare(batch: PagedBatch, *, causal: bool, config: PrefillConfig | None,
                    scale: float | None = None, tol: float | None = None) -> None:
    """Run the Triton prefill kernel (``config`` None: through the public dispatcher) on a
    NaN-filled ``out`` and compare out and lse with ``reference.paged_prefill_gather``."""
    query = batch.query
    out = torch.full_like(query, float("nan"))  # every element must be written
    if config is None:
        _, lse = paged_prefill(*batch.prefill_args, causal=causal, scale=scale, out=out,
                               return_lse=True, backend="triton")
    else:
        shapes = check_paged_prefill_args(*batch.prefill_args, scale, out)
        lse = torch.full(query.shape[:2], float("nan"), device=query.device)
        triton_paged_prefill(*batch.prefill_args, shapes, causal=causal, out=out, lse=lse,
                             config=config)
    ref_out, ref_lse = reference.paged_prefill_gather(
        *batch.prefill_args, causal=causal, scale=scale or query.shape[-1] ** -0.5)
    tol = tol or TOL[query.dtype]
    torch.testing.assert_close(out.float(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse, atol=tol, rtol=tol)
