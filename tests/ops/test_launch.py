"""The ops' launch cache on CPU: what gets a key, how the cache is bounded, and that the
interpreter (no compiled kernel) never prepares a launch. The fast path itself runs on CUDA
only: tests/ops/test_launch_cache_gpu.py."""

from __future__ import annotations

import pytest
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


def test_calls_aligned_differently_get_keys_of_their_own(monkeypatch):
    """Same shapes and strides, one pointer 16-byte aligned and one not: separate entries,
    so calls that alternate never replace each other's prepared launch (each replacement
    costs a full, slow call)."""
    from mini_paged_attn.ops import dispatch, launch
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    t = torch.zeros(64, dtype=torch.float16)
    aligned, shifted = t[0:8], t[1:9]           # 2 bytes apart
    assert aligned.data_ptr() % 16 == 0 and shifted.data_ptr() % 16 != 0
    assert dispatch._call_key((aligned,), ("auto",)) != dispatch._call_key((shifted,), ("auto",))
    keys = []
    monkeypatch.setattr(launch._LAUNCHES, "get", lambda key: keys.append(key))
    monkeypatch.setattr(launch._LAUNCHES, "put", lambda key, value: None)
    monkeypatch.setattr(launch, "PreparedLaunch", lambda *args: None)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(launch, "direct_launch_enabled", lambda: True)   # any Triton
    for x in (aligned, shifted):
        launch.launch(object(), (1,), (x, 8), {})
    assert len(keys) == 2 and keys[0][2:] != keys[1][2:]


@pytest.mark.tested_triton     # Triton's encoding of a descriptor argument
def test_tensor_descriptors_follow_the_tensor_argument_named_for_them():
    """A descriptor follows the argument position it was named for, not whichever argument
    holds the same tensor (k also passed as a scale pointer, or k is v), and expands as
    Triton's launcher takes it (without TMA: base pointer, shape, strides, padding flag,
    shape, strides)."""
    from types import SimpleNamespace

    from triton.tools.tensor_descriptor import TensorDescriptor

    from mini_paged_attn.ops.launch import PreparedLaunch
    x = torch.zeros(4, 8)
    kernel = SimpleNamespace(arg_names=["q", "k", "k_scale", "k_desc", "n"])

    def bound(sources):
        launch = object.__new__(PreparedLaunch)
        launch.ready = True
        desc = TensorDescriptor(x, [4, 8], [8, 1], [2, 8])
        # Prepared with one tensor as q, k and the scale stand-in (a user's q is k is v).
        launch._bind_arguments(kernel, (x, x, x, desc, 3), {}, 3, sources, None)
        return launch

    launch = bound((1,))
    first, second = launch._tail_for([100, 200, 300]), launch._tail_for([400, 500, 600])
    assert first[0].data_ptr() == 200 and second[0].data_ptr() == 500
    assert first[1:] == second[1:] == (4, 8, 8, 1, False, 4, 8, 8, 1, 3)
    assert not bound(()).ready       # a descriptor nobody named: never repeated


@pytest.mark.tested_triton
def test_repeat_tails_are_kept_per_combination_of_descriptor_pointers():
    """Two descriptors: a repeat over pointers seen together before reuses that tail; a new
    combination expands each descriptor for its own pointer (the one over k follows k, the
    one over v follows v) and keeps the result."""
    from types import SimpleNamespace

    from triton.tools.tensor_descriptor import TensorDescriptor

    from mini_paged_attn.ops.launch import PreparedLaunch
    x = torch.zeros(4, 8)
    kernel = SimpleNamespace(arg_names=["q", "k", "v", "k_desc", "v_desc"])
    launch = object.__new__(PreparedLaunch)
    launch.ready = True
    descs = [TensorDescriptor(x, [4, 8], [8, 1], [2, 8]) for _ in range(2)]
    launch._bind_arguments(kernel, (x, x, x, *descs), {}, 3, (1, 2), None)
    first = launch._tail_for([100, 200, 300])
    assert launch._tail_for([999, 200, 300]) is first      # q is no descriptor's source
    mixed = launch._tail_for([100, 200, 400])
    assert mixed is not first and mixed[:10] == first[:10]
    assert [mixed[0].data_ptr(), mixed[10].data_ptr()] == [200, 400]
    assert launch._tail_for([100, 200, 400]) is mixed


def test_descriptors_are_encoded_once_per_pointer(monkeypatch):
    """The encoding is a function of the pointer alone: kept per pointer, bounded."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from mini_paged_attn.ops.launch import _EncodedDescriptor
    x = torch.zeros(4, 8)
    encoded_for = []

    def encode(descriptor, metadata):
        encoded_for.append(descriptor.base.data_ptr())
        return [("map", descriptor.base.data_ptr(), metadata), *descriptor.shape]

    monkeypatch.setattr(_EncodedDescriptor, "MAX_POINTERS", 3)
    encoded = _EncodedDescriptor(TensorDescriptor(x, [4, 8], [8, 1], [2, 8]), "meta", encode)
    assert encoded.width == 3
    assert encoded.expand(200) == (("map", 200, "meta"), 4, 8)
    for address in (200, 300, 200, 300):
        encoded.expand(address)
    assert encoded_for == [x.data_ptr(), 200, 300]
    encoded.expand(400)          # a fourth pointer empties the map first
    encoded.expand(200)
    assert encoded_for[3:] == [400, 200]

