"""Programmatic dependent launch (PDL, sm_90+): a kernel starts while the one before it in
the stream is still finishing, and waits inside, before it touches memory, until that one
has completed and its writes are visible.

A decode step is ~250 short kernels, and between two plain launches the GPU drains one
kernel before it starts the next one's programs, under CUDA graphs too. Launched as
dependents, the library's kernels of a decode step (RMSNorm, rotary, SiLU-and-mul, paged
decode, and the projections at decode sizes, :mod:`.projection_triton`) overlap their start
with the end of the kernel before them; the more of a step's kernels are dependents (cuBLAS
launches plainly, so the projections in Triton count too), the more of the drains go
(docs/performance-notes.md, "Programmatic dependent launch" and "Projections at decode
sizes").

A kernel taking part declares ``PDL: tl.constexpr`` and calls :func:`wait_for_previous`
first, before any load or store; it is launched with ``PDL`` and ``launch_pdl`` set from
:func:`pdl_options` (:func:`~.launch.launch` adds them for kernels that declare ``PDL``).
Results never depend on it: the wait makes every read see the previous kernels' writes, as a
plain launch would.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAS_GRID_DEPENDENCY_CONTROL = True
except ImportError:   # Triton before 3.3: no griddepcontrol, every launch stays plain
    gdc_launch_dependents = gdc_wait = None
    HAS_GRID_DEPENDENCY_CONTROL = False


@functools.lru_cache(maxsize=None)
def pdl_supported(device_index: int) -> bool:
    """Whether CUDA device ``device_index`` runs programmatic dependent launches (sm_90+)."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_options(device: torch.device) -> dict:
    """A launch's ``PDL`` constexpr and ``launch_pdl`` option on ``device``: both True on a
    CUDA device of sm_90 or later, else False (a Triton without griddepcontrol: ``PDL``
    False and no ``launch_pdl``). CPU tensors (the Triton interpreter's) get False; like
    the fp8 kernels' inline PTX, PDL assumes CUDA tensors are launched compiled."""
    if not HAS_GRID_DEPENDENCY_CONTROL:
        return {"PDL": False}        # nor a launch_pdl option, which such a Triton rejects
    pdl = device.type == "cuda" and pdl_supported(
        device.index if device.index is not None else torch.cuda.current_device())
    return {"PDL": pdl, "launch_pdl": pdl}


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """The first statement of a kernel launched with :func:`pdl_options`. With ``PDL``: wait
    until the previous kernel in the stream has completed (its writes visible), then let
    the next dependent launch begin (its programs wait the same way). Without: nothing."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


__all__ = ["HAS_GRID_DEPENDENCY_CONTROL", "pdl_options", "pdl_supported", "wait_for_previous"]
