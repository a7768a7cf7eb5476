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


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
