"""Measurements that answer questions asked again and again (GPU): an engine or a kernel of two
source trees side by side, where an engine run's time goes, what a first request pays. The
table of scripts is in ``README.md``; what earlier experiments found is in
docs/performance-notes.md. They use the library's public interfaces and the tools of
``benchmarks``; the tools never import them.

:func:`import_tree` imports another checkout's ``mini_paged_attn``, so that an experiment can
run the same workload on two trees.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

PACKAGE = "mini_paged_attn"


def import_tree(tree: Path | str, name: str) -> ModuleType:
    """The ``mini_paged_attn`` package of the checkout ``tree`` (a directory holding
    ``mini_paged_attn/__init__.py``, e.g. made by ``git worktree add /tmp/base REV``),
    imported as the top-level package ``name``.

    The package's modules import each other relatively, so two trees can live in one process
    under two names. ``name="mini_paged_attn"``, before anything imported the library, makes
    the whole process (the benchmark tools' lazy imports included) use ``tree``'s. Importing
    the same tree under the same name again returns the module already imported.
    """
    init = Path(tree).expanduser().resolve() / PACKAGE / "__init__.py"
    if not init.is_file():
        raise ValueError(f"tree: expected a checkout holding {PACKAGE}/__init__.py, "
                         f"got {str(tree)!r}")
    if not name.isidentifier():
        raise ValueError(f"name: expected a Python identifier, got {name!r}")
    loaded = sys.modules.get(name)
    if loaded is not None:
        if Path(getattr(loaded, "__file__", "") or "").resolve() == init:
            return loaded
        raise ValueError(f"name: {name!r} is already imported from {loaded.__file__}, "
                         f"not from {init.parent}")
    spec = importlib.util.spec_from_file_location(name, init,
                                                  submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
