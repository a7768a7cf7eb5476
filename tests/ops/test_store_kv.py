"""store_kv: the Triton kernel (ops/kv_write.py) against the torch reference.

Runs through the Triton interpreter on CPU and natively on a GPU (same test).
"""

from __future__ import annotations

import pytest
import torch

from mini_paged_attn.ops.dispatch import store_kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _pool(num_blocks, block_size, num_kv_heads, head_size, dtype, seed_layout, gen):
    kv = torch.randn((num_blocks, block_size, 2, num_kv_heads, head_size), generator=gen)
    kv = kv.to(DEVICE, dtype)
    if seed_layout:  # the manager's strided views of the (blocks, block_size, 2, H, D) pool
        return kv, kv[:, :, 0], kv[:, :, 1]
    return kv, kv[:, :, 0].contiguous(), kv[:, :, 1].contiguous()


@pytest.mark.parametrize("block_size, num_kv_heads, head_size, dtype, seed_layout, slot_dtype", [
    (16, 2, 64, torch.float16, True, torch.int64),
    (1, 3, 80, torch.float32, False, torch.int32),
    (32, 8, 128, torch.bfloat16, True, torch.int32),
])
def test_triton_matches_torch(block_size, num_kv_heads, head_size, dtype, seed_layout,
                              slot_dtype):
    gen = torch.Generator().manual_seed(block_size + head_size)
    num_tokens = 9
    num_blocks = max(6, -(-2 * num_tokens // block_size))
    _, kc_t, vc_t = _pool(num_blocks, block_size, num_kv_heads, head_size, dtype, seed_layout,
                          gen)
    kc_x, vc_x = kc_t.clone(), vc_t.clone()
    if seed_layout:   # clone() of a strided view is contiguous: rebuild the strided layout
        pool = torch.stack([kc_t, vc_t], dim=2).clone()
        kc_x, vc_x = pool[:, :, 0], pool[:, :, 1]
    before = kc_t.clone(), vc_t.clone()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 5]] = -1                                  # padding tokens are skipped
    slots = slots.to(DEVICE, slot_dtype)
    key = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(DEVICE, dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(DEVICE, dtype)

    store_kv(key, value, kc_t, vc_t, slots, backend="torch")
    store_kv(key, value, kc_x, vc_x, slots, backend="triton")
    assert torch.equal(kc_x, kc_t) and torch.equal(vc_x, vc_t)

    # What was written is the tokens' K/V; everything else is unchanged.
    flat = slots.long()
    keep = flat >= 0
    kc_flat = kc_x.reshape(-1, num_kv_heads, head_size)
    vc_flat = vc_x.reshape(-1, num_kv_heads, head_size)
    assert torch.equal(kc_flat[flat[keep]], key[keep])
    assert torch.equal(vc_flat[flat[keep]], value[keep])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[flat[keep]] = False
    assert torch.equal(kc_flat[untouched], before[0].reshape(-1, num_kv_heads, head_size)[untouched])
    assert torch.equal(vc_flat[untouched], before[1].reshape(-1, num_kv_heads, head_size)[untouched])


def test_triton_skips_slots_beyond_the_pool_and_all_padding():
    gen = torch.Generator().manual_seed(0)
    _, kc, vc = _pool(2, 4, 1, 16, torch.float32, False, gen)
    before = kc.clone(), vc.clone()
    key = torch.randn(3, 1, 16, generator=gen).to(DEVICE)
    slots = torch.tensor([-1, 8, 100], dtype=torch.int64, device=DEVICE)  # pool has 8 slots
    store_kv(key, key, kc, vc, slots, backend="triton")
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])
