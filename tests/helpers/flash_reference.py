"""FlashAttention's forward semantics from their definitions, in float64, for the tests of the
drop-in functions (``ops/varlen.py``, ``ops/flash_api.py``, ``ops/kvcache_api.py``).

``softmax(Q K^T * scale + mask) V`` per sequence, with FlashAttention's bottom-right alignment:
query row ``t`` of ``q_len`` over ``k_len`` keys sits at ``p = k_len - q_len + t`` and sees keys
``p - left .. p + right`` (causal: ``right = 0``; -1: unbounded). A row that sees no key gives
0 and lse ``-inf``. Written independently of ``ops/reference.py``: a dense score matrix and an
explicit mask, no gathers, no online softmax.

Use from any test (tests/ is on sys.path through tests/conftest.py)::

    from helpers.flash_reference import attend, attend_varlen
"""

from __future__ import annotations

import math

import torch


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           interleaved: bool) -> torch.Tensor:
    """Rotary embedding of ``x [n, heads, D]`` by ``cos, sin [n, R/2]`` (``R <= D``): pairs
    ``(2i, 2i+1)`` when ``interleaved`` (GPT-J), else ``(i, i + R/2)`` (GPT-NeoX); dims past
    ``R`` pass through. Returns x's dtype."""
    half = cos.shape[-1]
    xr = x[..., :2 * half].double()
    c, s = cos.double()[:, None], sin.double()[:, None]
    if interleaved:
        a, b = xr[..., 0::2], xr[..., 1::2]
        rotated = torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)
    else:
        a, b = xr[..., :half], xr[..., half:]
        rotated = torch.cat([a * c - b * s, a * s + b * c], dim=-1)
    return torch.cat([rotated.to(x.dtype), x[..., 2 * half:]], dim=-1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
           causal: bool = False, window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
           first_key: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q ``[q_len, Hq, D]``, k / v ``[k_len, Hkv, D]`` (GQA: query head ``h``
    reads KV head ``h // (Hq // Hkv)``). ``first_key``: keys before it are masked (a left-padded
    cache row), positions still counted from key 0. Returns float64 out ``[q_len, Hq, D]``
    and lse ``[Hq, q_len]``."""
    q_len, hq, d = q.shape
    k_len = k.shape[0]
    scale = d ** -0.5 if scale is None else scale
    group = hq // k.shape[1]
    kd = k.double().repeat_interleave(group, dim=1)
    vd = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kd) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    left, right = window
    if causal:
        right = 0
    pos = (k_len - q_len + torch.arange(q_len))[:, None]
    key = torch.arange(k_len)[None, :]
    seen = (key >= first_key).expand(q_len, k_len).clone()
    if right >= 0:
        seen &= key <= pos + right
    if left >= 0:
        seen &= key >= pos - left
    scores = scores.masked_fill(~seen, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)                       # -inf where no key is seen
    probs = torch.where(seen, torch.exp(scores - lse[..., None].clamp(min=-1e300)), 0.0)
    out = torch.einsum("hqk,khd->qhd", probs, vd)
    return out, lse


def attend_varlen(q, k, v, cu_q: torch.Tensor, cu_k: torch.Tensor, **options
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attend` over each sequence of a varlen batch (q ``[total_q, Hq, D]``, k / v
    ``[total_k, Hkv, D]``, int ``[num_seqs + 1]`` offsets). Returns float64 out
    ``[total_q, Hq, D]`` and lse ``[Hq, total_q]`` (FlashAttention's varlen layout)."""
    outs, lses = [], []
    for i in range(cu_q.shape[0] - 1):
        qs, qe, ks, ke = (int(x) for x in (cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]))
        o, l = attend(q[qs:qe], k[ks:ke], v[ks:ke], **options)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs), torch.cat(lses, dim=1)
