import pytest
import torch
from helpers.tiny_models import tiny_model_factory  # noqa: F401  (the session fixture)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    # Tiny matmuls on a loaded 2-core machine: OpenMP threads spin against each other and a
    # 64x128 linear takes milliseconds instead of microseconds.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
