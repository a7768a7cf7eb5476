import pytest
from helpers.tiny_models import tiny_model_factory  # noqa: F401  (the session fixture)

from mini_paged_attn.errors import ModelLoadError
from mini_paged_attn.models import gguf
from mini_paged_attn.models.packaged import PACKAGED_MODELS, packaged_model_path


@pytest.fixture(scope="session")
def smollm2_path():
    """The packaged smollm2-135m GGUF file; the test is skipped, saying why, when the ``real``
    extra is missing or the file cannot be fetched."""
    if gguf.gguf_missing() is not None:
        pytest.skip("the 'real' extra is not installed (pip install -e \".[real]\")")
    try:
        return packaged_model_path(PACKAGED_MODELS["smollm2-135m"])
    except ModelLoadError as exc:
        pytest.skip(f"smollm2-135m could not be fetched from the package index: {exc}")
