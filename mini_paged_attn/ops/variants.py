"""Attention variants shared by every backend: sliding windows, logit soft-capping, sinks.

The names and meanings are FlashAttention's (``window_size``, ``softcap``) and gpt-oss's
(``sinks``), so a model ported from either needs no translation:

- ``window_size=(left, right)``: the query at absolute position ``p`` sees keys
  ``p - left .. p + right``; ``-1`` leaves that side unbounded. With ``causal`` the right side
  is clamped to 0 (a causal query never sees a later key). ``(0, 0)`` sees only the token
  itself. Positions are bottom-right aligned: in a sequence with ``q_len`` queries and
  ``k_len`` keys, query row ``t`` sits at ``p = k_len - q_len + t`` (decode: ``k_len - 1``).
- ``softcap``: scores (after the softmax scale) become ``softcap * tanh(score / softcap)``
  before the softmax (Gemma 2, Grok); 0 turns it off.
- ``sinks``: float32 ``[num_q_heads]``, one logit per query head that joins the softmax
  denominator and nothing else (a "sink" key whose value is zero)::

      out = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) + exp(sink - m))

  The returned lse is the log of that whole denominator, the sink included, so it stays the
  normaliser of ``out``: ``out = sum_j exp(s_j - lse) v_j``. A query that sees no key then
  gives ``out = 0`` and ``lse = sink``.

Memory contract: a KV block that lies wholly left of every query's window in a call is never
read by any backend, so its block-table entry may already point at a block that was freed and
reused. Partial blocks at a window's edge are read, masked position by position.
"""

from __future__ import annotations

import math

import torch

from ..core.args import arg_error, is_int, is_number

NO_WINDOW = (-1, -1)


def check_window(window_size: object, name: str = "window_size") -> tuple[int, int]:
    """Return ``window_size`` as ``(left, right)`` Python ints, each ``>= -1``.

    Accepts a tuple or list of two ints (not bools); anything else is a ValueError naming
    ``name``.
    """
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(is_int(w) and w >= -1 for w in window_size)):
        raise arg_error(name, "a (left, right) pair of ints >= -1 (-1: unbounded)",
                        repr(window_size))
    return int(window_size[0]), int(window_size[1])


def check_softcap(softcap: object, name: str = "softcap") -> float:
    """Return ``softcap`` as a float: finite and ``>= 0`` (0 = off), else ValueError."""
    if not is_number(softcap) or not 0.0 <= softcap < math.inf:
        raise arg_error(name, "a finite float >= 0 (0 turns soft-capping off)", repr(softcap))
    return float(softcap)


def check_sinks(sinks: object, num_q_heads: int, device: torch.device,
                name: str = "sinks") -> None:
    """``sinks``: None, or a float32 tensor ``[num_q_heads]`` on ``device``."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        raise arg_error(name, f"None or a float32 tensor [num_q_heads={num_q_heads}]",
                        type(sinks).__name__)
    if (sinks.dtype != torch.float32 or tuple(sinks.shape) != (num_q_heads,)
            or sinks.device != device):
        raise arg_error(name, f"a float32 tensor of shape ({num_q_heads},) on {device} "
                        "(one logit per query head, on the query's device)",
                        f"a {sinks.dtype} tensor of shape {tuple(sinks.shape)} on {sinks.device}")


def check_variant(window_size: object, softcap: object, sinks: object, num_q_heads: int,
                  device: torch.device) -> tuple[tuple[int, int], float]:
    """All three options at once; returns the normalised ``(window, softcap)``."""
    window = check_window(window_size)
    cap = check_softcap(softcap)
    check_sinks(sinks, num_q_heads, device)
    return window, cap


def effective_right(window: tuple[int, int], causal: bool) -> int:
    """The right bound a kernel applies: 0 under ``causal`` (FlashAttention clamps it), else
    the window's (-1: unbounded)."""
    return 0 if causal else window[1]


def visible_range(pos: torch.Tensor, k_len: torch.Tensor, left: int,
                  right: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys a query at position ``pos`` sees: positions ``lo .. hi - 1`` (int64, same shape as
    ``pos``; ``hi >= lo``, empty when equal). ``k_len`` (broadcastable) bounds the keys.

    ``left`` / ``right``: the window's sides as a kernel applies them (see
    :func:`effective_right`), -1 for unbounded.
    """
    lo = (pos - left).clamp(min=0) if left >= 0 else torch.zeros_like(pos)
    hi = torch.minimum(pos + right + 1, k_len) if right >= 0 else k_len.expand_as(pos).clone()
    hi = hi.clamp(min=0)
    lo = torch.minimum(lo, hi)
    return lo, hi


def window_tokens(left: int, max_len: int) -> int:
    """The most keys one decode query reads: ``left + 1`` with a left window, else ``max_len``
    (capped at ``max_len``)."""
    return max_len if left < 0 else min(max_len, left + 1)


__all__ = ["NO_WINDOW", "check_window", "check_softcap", "check_sinks", "check_variant",
           "effective_right", "visible_range", "window_tokens"]
