"""The ops' launch cache on CPU: what gets a key, how the cache is bounded, and that the
interpreter (no compiled kernel) never prepares a launch. The fast path itself runs on CUDA
only: tests/ops/test_launch_cache_gpu.py."""

from __future__ import annotations

import torch

from mini_paged_attn.ops.dispatch import _call_key
from mini_paged_attn.ops.kv_write import triton_store_kv
from mini_paged_attn.ops.launch import LaunchCache


def test_cpu_tensors_non_tensors_and_unhashable_options_get_no_key():
    t = torch.zeros(2, 3)
    assert _call_key((t, t), ("auto",)) is None                  # CPU: no fast path
    assert _call_key((t, [1, 2]), ("auto",)) is None             # not a tensor
    assert _call_key((t,), ([0.5],)) is None                     # unhashable option


def test_cache_is_emptied_when_full():
    cache = LaunchCache(max_entries=3)
    for i in range(3):
        cache.put(i, str(i))
    assert [cache.get(i) for i in range(3)] == ["0", "1", "2"]
    cache.put(3, "3")
    assert len(cache) == 1 and cache.get(0) is None and cache.get(3) == "3"


def test_the_interpreter_prepares_nothing():
    pool = torch.zeros(4, 16, 2, 2, 16)
    k = torch.randn(3, 2, 16)
    slots = torch.tensor([0, 17, 63])
    assert triton_store_kv(k, k, pool[:, :, 0], pool[:, :, 1], slots) is None
    torch.testing.assert_close(pool[:, :, 0].reshape(-1, 2, 16)[slots], k)


def test_options_are_keyed_with_their_types(monkeypatch):
    from mini_paged_attn.ops import dispatch
    # Pretend the tensor is on CUDA device 0 (on CPU there is no key at all).
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    t = torch.zeros(2)
    assert dispatch._call_key((t,), (True,)) is not None
    assert dispatch._call_key((t,), (True,)) != dispatch._call_key((t,), (1,))
    assert dispatch._call_key((t,), (None,)) == dispatch._call_key((t,), (None,))
