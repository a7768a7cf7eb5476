"""Checks of scalar arguments, the same way in every layer; integer rounding on the host.

Python's ``bool`` is an ``int``, and numpy / torch integer scalars are not; an index must accept
the latter and refuse the former, the same way everywhere. A flag must be a real ``bool``: a
truthy 1 or "no" is a caller's mistake.
"""

from __future__ import annotations

import operator


def arg_error(name: str, expected: str, got: object) -> ValueError:
    """The error for a bad argument: ``"{name}: expected {expected}, got {got}"``."""
    return ValueError(f"{name}: expected {expected}, got {got}")


def is_int(value: object) -> bool:
    """A Python int, and not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An int or a float, and not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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


def _int_at_least(name: str, value: object, low: int, expected: str) -> int:
    try:
        v = as_int(name, value)
    except TypeError:
        raise arg_error(name, expected, repr(value)) from None
    if v < low:
        raise arg_error(name, expected, repr(value))
    return v


def positive_int(name: str, value: object) -> int:
    """Return ``value`` as a Python int >= 1, or raise ValueError naming ``name``.

    Accepts what :func:`as_int` accepts; anything else (a bool, a float, a string) is a
    ValueError too, since for a size or a count a value of the wrong type is a bad value. An
    index argument that must refuse a non-integer with TypeError calls :func:`as_int` first.
    """
    return _int_at_least(name, value, 1, "a positive int")


def non_negative_int(name: str, value: object) -> int:
    """:func:`positive_int` for a length or a bound that may be 0."""
    return _int_at_least(name, value, 0, "a non-negative int")


def check_bool(name: str, value: object) -> bool:
    """Return ``value`` if it is a ``bool``, else raise ValueError naming ``name``."""
    if not isinstance(value, bool):
        raise arg_error(name, "a bool", repr(value))
    return value


def cdiv(a, b):
    """``ceil(a / b)`` for integers, ``b > 0``: exact at any size (``math.ceil(a / b)`` rounds
    through a float). Elementwise on numpy and torch integer arrays too."""
    return -(-a // b)


def next_pow2(x: int) -> int:
    """The smallest power of two ``>= x`` (1 for ``x <= 1``)."""
    return 1 << max(0, x - 1).bit_length()


__all__ = ["arg_error", "as_int", "cdiv", "check_bool", "is_int", "is_number", "next_pow2",
           "non_negative_int", "positive_int"]
