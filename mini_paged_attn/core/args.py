"""Coercion of integer arguments, shared by the block manager and the KV cache manager.

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
