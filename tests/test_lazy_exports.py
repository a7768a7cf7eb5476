"""The packages' lazy exports: a re-exported name and a subpackage are there on first access,
as an eager ``__init__`` would have made them, and nothing is imported before."""

import subprocess
import sys
import textwrap


def test_names_and_subpackages_import_on_first_access():
    code = textwrap.dedent("""
        import sys
        import mini_paged_attn as m
        assert "mini_paged_attn.ops" not in sys.modules and "torch" not in sys.modules
        assert m.ops.paged_decode is m.paged_decode           # a subpackage, then a name
        import mini_paged_attn.models as models
        assert models.tiny.tiny_llama is models.tiny_llama
        for package, name in ((m, "nothing"), (models, "__path_hooks__")):
            try:
                getattr(package, name)
            except AttributeError as exc:
                assert repr(name) in str(exc)
            else:
                raise AssertionError(name)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
