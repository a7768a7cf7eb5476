"""Programmatic dependent launches on a GPU: a chain of the library's kernels and cuBLAS
GEMMs, each reading what the one before it wrote, gives the same bits launched as dependents
(sm_90+) as launched plainly, eagerly and replayed from a CUDA graph.

Run: ``pytest -m gpu tests/ops/test_pdl_gpu.py`` on a CUDA machine.
"""

from __future__ import annotations

import pytest
import torch

from helpers.cuda_graphs import capture
from helpers.paged_batch import make_decode_batch
from mini_paged_attn.ops import dispatch, launch, pdl
from mini_paged_attn.ops.decode import workspace_size
from mini_paged_attn.ops.dispatch import paged_decode
from mini_paged_attn.ops.attention.decode_plan import MAX_SPLITS
from mini_paged_attn.ops.fused import KVWrite, apply_rotary, rms_norm, silu_and_mul

pytestmark = pytest.mark.gpu

HIDDEN, Q_HEADS, KV_HEADS, HEAD, INTER, BLOCK = 256, 8, 2, 64, 512, 16


def _layers(seed: int, num_layers: int = 6):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def weight(*shape):
        return (torch.randn(*shape, device="cuda", generator=gen) / shape[-1] ** 0.5).bfloat16()
    qkv = (Q_HEADS + 2 * KV_HEADS) * HEAD
    return [dict(norm=1 + weight(HIDDEN) / 8, qkv=weight(qkv, HIDDEN),
                 o=weight(HIDDEN, Q_HEADS * HEAD), gate_up=weight(2 * INTER, HIDDEN),
                 down=weight(HIDDEN, INTER)) for _ in range(num_layers)]


def _step(x, layers, caches, positions, cos_sin, lens, workspace):
    """A decoder step: per layer RMSNorm, GEMM, rotary writing the new K/V, paged decode over
    them, GEMM, RMSNorm with the residual, GEMM, SiLU-and-mul, GEMM. ``caches``: per layer
    ``(key_cache, value_cache, block_tables, slots)``. With a ``workspace`` the split decode
    merges in a kernel of its own (a plain launch), as in the engine's graphs; without,
    inside the decode kernel."""
    residual = None
    n = x.shape[0]
    for layer, (key_cache, value_cache, tables, slots) in zip(layers, caches):
        if residual is None:
            x, residual = rms_norm(x, layer["norm"], 1e-6), x
        else:
            x, residual = rms_norm(x, layer["norm"], 1e-6, residual=residual)
        q, k, v = (x @ layer["qkv"].T).split(
            [Q_HEADS * HEAD, KV_HEADS * HEAD, KV_HEADS * HEAD], dim=-1)
        q, _ = apply_rotary(q.view(n, Q_HEADS, HEAD), k.view(n, KV_HEADS, HEAD), positions,
                            cos_sin, store=KVWrite(v.view(n, KV_HEADS, HEAD), key_cache,
                                                   value_cache, slots))
        attn = paged_decode(q, key_cache, value_cache, tables, lens,
                            **({} if workspace is None else {"workspace": workspace}))
        x = attn.view(n, -1) @ layer["o"].T
        x, residual = rms_norm(x, layer["norm"], 1e-6, residual=residual)
        x = silu_and_mul(x @ layer["gate_up"].T) @ layer["down"].T
    return x + residual


def _run(seed: int, graph: bool, workspace: bool):
    """The step's output and the caches it wrote, over fresh inputs of ``seed``."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lens_list = [1, BLOCK - 1, BLOCK, BLOCK + 1, 300, 999, 64, 2]
    n = len(lens_list)
    layers = _layers(seed)
    # Each layer's caches (unused slots NaN) over shuffled blocks, as the ops' tests build them.
    batches = [make_decode_batch(lens_list, num_q_heads=Q_HEADS, num_kv_heads=KV_HEADS,
                                 head_size=HEAD, block_size=BLOCK, dtype=torch.bfloat16,
                                 seed=seed + i, pool_layout=True, device="cuda")
               for i in range(len(layers))]
    lens = batches[0].context_lens
    positions = (lens - 1).long()
    caches = [(b.key_cache, b.value_cache, b.block_tables,
               b.block_tables.gather(1, (positions // BLOCK)[:, None])[:, 0].long() * BLOCK
               + positions % BLOCK) for b in batches]
    angles = torch.arange(1024, device="cuda")[:, None] * torch.rand(
        HEAD // 2, device="cuda", generator=gen)
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).bfloat16()
    x = torch.randn(n, HIDDEN, device="cuda", generator=gen).bfloat16()
    ws = (torch.empty(workspace_size(n, Q_HEADS, HEAD, MAX_SPLITS), device="cuda")
          if workspace else None)
    args = (x, layers, caches, positions, cos_sin, lens, ws)
    written = [(b.key_cache, b.value_cache) for b in batches]
    if not graph:
        return _step(*args), written
    cuda_graph, out = capture(lambda: _step(*args))
    for _ in range(3):             # each replay rewrites the same slots with the same values
        cuda_graph.replay()
    torch.cuda.synchronize()
    return out.clone(), written


def _plain(monkeypatch):
    monkeypatch.setattr(pdl, "pdl_supported", lambda device_index: False)
    launch._LAUNCHES.clear()
    dispatch._DECODE_RUNS.clear()


@pytest.mark.direct_launch     # reads the kept launches
def test_dependent_launches_are_on_from_sm90():
    capable = torch.cuda.get_device_capability()[0] >= 9
    assert pdl.pdl_options(torch.device("cuda")) == {"PDL": capable, "launch_pdl": capable}
    launch._LAUNCHES.clear()
    x = torch.randn(4, HIDDEN, device="cuda").bfloat16()
    rms_norm(x, torch.ones(HIDDEN, device="cuda").bfloat16(), 1e-6)
    kernels = [entry.kernel for entry in launch._LAUNCHES._entries.values()]
    assert [k.metadata.launch_pdl for k in kernels] == [capable]


@pytest.mark.parametrize("workspace", [False, True], ids=["fused_merge", "workspace"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_dependent_chain_gives_the_bits_of_plain_launches(monkeypatch, graph, workspace):
    dependent, dependent_caches = _run(seed=7, graph=graph, workspace=workspace)
    with monkeypatch.context() as patch:
        _plain(patch)
        plain, plain_caches = _run(seed=7, graph=graph, workspace=workspace)
    launch._LAUNCHES.clear()
    dispatch._DECODE_RUNS.clear()
    assert torch.isfinite(plain.float()).all()
    assert torch.equal(dependent, plain)
    for dependent_cache, plain_cache in zip(dependent_caches, plain_caches):
        for a, b in zip(dependent_cache, plain_cache):     # bits: unused slots hold NaN
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
