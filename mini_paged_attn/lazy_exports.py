"""Package attributes imported on first use (PEP 562), so that importing a package for one
light module does not import torch, transformers and the kernels with it: ``mini-paged-attn
serve`` starts its engine process before its own process imports torch, and ``--help``
answers at once."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, namespace: dict[str, Any],
                 exports: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports ``exports[name]`` (a module
    relative to the package) on first access of ``name`` and keeps the value in
    ``namespace`` (the package's globals), so later lookups are plain attribute reads.

    A name that is not exported but is a submodule (``package.ops``) is imported, as an eager
    ``__init__`` would have made it an attribute."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is not None:
            value = getattr(importlib.import_module(module, package), name)
        elif not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}"):
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    return __getattr__


__all__ = ["lazy_exports"]
