"""Test set-up shared by the whole suite.

Without CUDA, Triton kernels run through the interpreter (``TRITON_INTERPRET=1``), which must
be set before any kernel is defined, so it happens here, before the package is imported.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist each worker is a process: one torch thread each keeps 2 workers from
# fighting over 2 cores (measured: 3x faster than torch's default threads per worker).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def pytest_configure(config):
    config.addinivalue_line("markers", "tested_triton: reads Triton internals; skipped on a "
                            "Triton outside ops.triton_support.TESTED_TRITON_VERSIONS")
    config.addinivalue_line("markers", "direct_launch: asserts a prepared repeat or the Gluon "
                            "prefill; skipped where ops.triton_support turns the direct launch "
                            "off (an untested Triton, MINI_PAGED_ATTN_PUBLIC_LAUNCH=1)")


def _triton_skips() -> dict[str, pytest.MarkDecorator]:
    """The skip of each Triton marker that does not hold here, with the gate's reason."""
    from mini_paged_attn.ops.backend import triton_available
    if not triton_available():
        return {}
    from mini_paged_attn.ops.triton_support import triton_support
    support = triton_support()
    skips = {}
    if not support.tested:
        skips["tested_triton"] = pytest.mark.skip(reason=support.describe())
    if not support.direct_launch:
        skips["direct_launch"] = pytest.mark.skip(reason=support.describe())
    return skips


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    triton_skips = _triton_skips()
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        for marker, skip in triton_skips.items():
            if marker in item.keywords:
                item.add_marker(skip)
