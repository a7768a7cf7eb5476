"""Integer arguments, the same way in every layer: coercion, the positive-int check, ceil division.

Python's ``bool`` is an ``int``, and numpy / torch integer scalars are not; an index must accept
the latter and refuse the former, the same way everywhere.
"""

from __future__ import annotations

import operator


def as_int(name: str, value: object) -> int:
    """Return ``value`` as a Python int, or raise TypeError naming ``name``.

    Accepts ``int`` and anything with ``__index__`` (numpy integer scalars, one-element integer
    torch tensors). Refuses ``bool`` (and boolean numpy / torch scalars), floats and strings.
    """
    dtype = getattr(value, "dtype", None)
    if isinstance(value, bool) or (dtype is not None and "bool" in str(dtype)):
        raise TypeError(f"{name}: expected an int, got a bool ({value!r})")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an int, "
                        f"got {type(value).__name__} ({value!r})") from None


def positive_int(name: str, value: object) -> int:
    """Return ``value`` as a Python int >= 1, or raise ValueError naming ``name``.

    Accepts what :func:`as_int` accepts; anything else (a bool, a float, a string) is a
    ValueError too, since for a size or a count a value of the wrong type is a bad value. An
    index argument that must refuse a non-integer with TypeError calls :func:`as_int` first.
    """
    try:
        v = as_int(name, value)
    except TypeError:
        v = 0
    if v < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return v


def cdiv(a, b):
    """``ceil(a / b)`` for integers, ``b > 0``: exact at any size (``math.ceil(a / b)`` rounds
    through a float). Elementwise on numpy and torch integer arrays too."""
    return -(-a // b)


__all__ = ["as_int", "cdiv", "positive_int"]
