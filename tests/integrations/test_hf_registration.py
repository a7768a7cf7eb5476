"""When importing mini_paged_attn registers with transformers, and what it costs."""

import subprocess
import sys

import pytest

_REGISTERED = ("from transformers import AttentionInterface\n"
               "from transformers.masking_utils import AttentionMaskInterface\n"
               "print('mini_paged_attn' in AttentionInterface._global_mapping,\n"
               "      'mini_paged_attn' in AttentionMaskInterface._global_mapping)\n")


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          timeout=120).stdout.strip()


def test_import_alone_does_not_load_transformers_modeling():
    # Registering imports transformers.modeling_utils (seconds); a plain import skips it.
    assert _run("import sys, mini_paged_attn\n"
                "print('transformers.modeling_utils' in sys.modules)") == "False"


def test_import_after_transformers_registers():
    assert _run("import transformers, mini_paged_attn\n" + _REGISTERED) == "True True"


def test_register_after_a_plain_import():
    assert _run("import mini_paged_attn\n"
                "from mini_paged_attn.integrations.transformers import register\n"
                "assert register() == 'mini_paged_attn'\n" + _REGISTERED) == "True True"


def test_register_names_what_an_older_transformers_lacks(monkeypatch):
    import transformers.masking_utils

    from mini_paged_attn.integrations.transformers import register

    monkeypatch.delattr(transformers.masking_utils, "AttentionMaskInterface")
    with pytest.raises(ImportError, match="AttentionMaskInterface"):
        register()
