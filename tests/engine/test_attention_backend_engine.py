"""The engine picks its attention backend once and asks it for its decode workspace, the
memory its calls may take beyond a profiled step and its warm-up batches."""

from __future__ import annotations

import dataclasses

import torch

from mini_paged_attn.engine import LLMEngine
from mini_paged_attn.engine.config import EngineConfig
from mini_paged_attn.engine.worker import pool_sizing
from mini_paged_attn.ops.attention import TORCH, TRITON, WarmupBatch

HEADS = dict(num_attention_heads=4, num_key_value_heads=2)
LIMITS = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
              cpu_kv_cache_bytes=1 << 20)


def _engine(tiny_model_factory, **config) -> LLMEngine:
    return LLMEngine.from_model(tiny_model_factory("llama", **HEADS), dtype="float32",
                                device="cpu", config=EngineConfig(**LIMITS, **config))


def test_the_runner_keeps_the_backend_it_chose(tiny_model_factory):
    runner = _engine(tiny_model_factory).runner
    assert runner.attention is TORCH and runner.backend == "torch"
    assert runner.workspace is None
    limits = runner.attention_limits
    assert (limits.max_num_seqs, limits.table_width) == (4, runner.table_width)
    assert limits.spec.head_size == runner.model_config.head_size


def test_a_triton_engine_takes_the_backend_workspace(tiny_model_factory):
    runner = _engine(tiny_model_factory, backend="triton").runner    # the interpreter
    assert runner.attention is TRITON and runner.backend == "triton"
    expected = TRITON.decode_workspace(runner.attention_limits)
    assert runner.workspace.shape == expected.shape and runner.workspace.dtype == torch.float32


class _Recording:
    """A backend in the runner's place that names its own warm-up batches and reserve."""

    op_backend = "torch"

    def __init__(self):
        self.limits = []

    def warmup_shapes(self, limits):
        self.limits.append(limits)
        return [WarmupBatch(2, 3, no_prefix=False), WarmupBatch(1, 1)]

    def workspace_bytes(self, limits):
        self.limits.append(limits)
        return 12345


def test_warm_up_runs_the_backend_batches(tiny_model_factory, monkeypatch):
    runner = _engine(tiny_model_factory).runner
    backend = runner.attention = _Recording()
    calls = []
    monkeypatch.setattr(runner, "run_dummy", lambda q_lens, caches, *, decode_only,
                        no_prefix=True, cascade=False: calls.append(
                            (q_lens, decode_only, no_prefix, cascade)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    runner.inputs.logit_buckets = None
    runner._warm_up(LIMITS["max_model_len"])
    assert backend.limits == [runner.attention_limits]
    # The backend's batches first, each followed by a cascade step of the same sizes (the
    # engine's rule is on by default), then the engine's own power-of-two prompts (cuBLAS).
    assert calls[:4] == [([3, 3], False, False, False), ([3, 3], False, False, True),
                         ([1], True, True, False), ([1], True, False, True)]
    assert all(len(q) == 1 and not d and not c for q, d, _, c in calls[4:])


def test_pool_sizing_leaves_the_backend_reserve_free(tiny_model_factory, monkeypatch):
    runner = _engine(tiny_model_factory).runner
    runner.attention = backend = _Recording()
    monkeypatch.setattr(runner, "device", torch.device("cuda"))
    monkeypatch.setattr(pool_sizing, "profile_step_memory", lambda r, n: 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    per_block = pool_sizing.kv_block_bytes(runner.model_config, runner.block_size,
                                           runner.kv_dtype, runner.layout.num_kv_heads)
    total = 1000 * per_block
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total, total))
    config = dataclasses.replace(runner.config, enforce_eager=True, gpu_memory_utilization=1.0)
    monkeypatch.setattr(runner, "config", config)
    assert pool_sizing.auto_num_blocks(runner, 64) == (total - 12345) // per_block
    assert backend.limits == [runner.attention_limits]
