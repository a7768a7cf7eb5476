"""Releasing an LLM gives its memory back: ``shutdown()`` drops the KV pool, the graphs, the
workspaces and the weights even while the LLM object is still held, and ``del llm`` frees
them by reference counting alone (no cycle waits for the garbage collector). Nothing global
(the launch caches of ``ops``) keeps a tensor of a dead engine."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from mini_paged_attn.engine import LLM, EngineConfig, LLMEngine, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# 16384 blocks of the tiny model's 8 KiB: a 128 MiB pool.
NUM_BLOCKS = 16384


def _llm(**options) -> LLM:
    return LLM("tiny", device="cpu", block_size=16, num_kv_blocks=NUM_BLOCKS,
               max_model_len=256, max_num_seqs=4, **options)


def _device_refs(llm: LLM) -> dict[str, weakref.ref]:
    runner = llm.engine.runner
    return {"pool": weakref.ref(runner.cache.pool),
            "weight": weakref.ref(next(runner.model.parameters())),
            "model": weakref.ref(runner.model), "runner": weakref.ref(runner),
            "sampler": weakref.ref(runner.sampler)}


def _alive(refs: dict[str, weakref.ref]) -> list[str]:
    return [name for name, ref in refs.items() if ref() is not None]


def test_shutdown_releases_the_pool_and_weights_while_the_llm_is_held():
    llm = _llm()
    llm.generate(["hello there", [5, 6, 7]], PARAMS, use_tqdm=False)
    refs = _device_refs(llm)
    del refs["runner"]              # the runner object stays (it raises on use)
    llm.shutdown()
    gc.collect()
    assert _alive(refs) == []
    llm.shutdown()                  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(["again"], PARAMS, use_tqdm=False)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.engine.memory_map()


@pytest.mark.parametrize("release", ["del", "shutdown then del", "with"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_last_reference_frees_everything_without_the_collector(release, async_scheduling):
    """With the collector off, only reference counting frees: a cycle anywhere through the
    engine would keep the pool (the first engine's pool on a GPU, when the next one sizes
    its own)."""
    llm = _llm(async_scheduling=async_scheduling)
    llm.generate(["hello there", [5, 6, 7]], PARAMS, use_tqdm=False)
    # Requests left in flight (an async step not yet resolved) must not pin anything either.
    llm.engine.add_request([9, 10, 11], PARAMS)
    llm.engine.step()
    refs = _device_refs(llm)
    refs["engine"] = weakref.ref(llm.engine)
    gc.collect()
    gc.disable()
    try:
        if release == "with":
            with llm:
                pass
        elif release == "shutdown then del":
            llm.shutdown()
        del llm
        assert _alive(refs) == []
    finally:
        gc.enable()


def test_an_engine_from_an_in_memory_model_lets_go_of_it():
    from mini_paged_attn.models.tiny import tiny_llama
    model, config, tokenizer = tiny_llama()
    weight = weakref.ref(next(model.parameters()))
    engine = LLMEngine(model, tokenizer, config, EngineConfig(block_size=16, num_kv_blocks=64))
    del model
    LLM.from_engine(engine).generate([[5, 6]], PARAMS, use_tqdm=False)
    engine.shutdown()
    assert weight() is None


def test_a_cached_launch_holds_no_descriptor_tensor():
    """A prepared launch's tensor descriptor is kept as its layout over a pointer: the
    descriptor itself holds its base tensor (on a GPU, a layer's view of the whole KV pool,
    kept alive by the global launch caches after its engine was gone)."""
    pytest.importorskip("triton")
    from triton.tools.tensor_descriptor import TensorDescriptor

    from mini_paged_attn.ops.launch import _EncodedDescriptor

    base = torch.zeros(64, 32)
    address = base.data_ptr()
    ref = weakref.ref(base)
    descriptor = TensorDescriptor(base, [64, 32], [32, 1], [16, 32])

    def encode(d, metadata):
        return (d.base.data_ptr(), *d.shape, *d.strides, *d.block_shape)

    encoded = _EncodedDescriptor(descriptor, None, encode)
    del descriptor, base
    assert ref() is None
    assert encoded.expand(address) == (address, 64, 32, 32, 1, 16, 32)
    assert encoded.expand(address + 4096) == (address + 4096, 64, 32, 32, 1, 16, 32)
    assert encoded.width == 7


def _hopper_shaped_llm(num_kv_blocks: int) -> LLM:
    """bf16 with head size 128 and prompts of 300 tokens: on an H100 / H200 the prompt steps
    take the Hopper prefill, whose cached launches hold tensor descriptors of the cache."""
    from mini_paged_attn.models import tiny
    from mini_paged_attn.models.config import ModelConfig
    from mini_paged_attn.models.registry import init_empty_model
    from mini_paged_attn.models.tokenizer import Tokenizer

    config = ModelConfig.from_dict({**tiny.TINY_LLAMA_CONFIG, "head_dim": 128, "hidden_size": 256,
                                    "num_attention_heads": 2, "num_key_value_heads": 1,
                                    "torch_dtype": "bfloat16"})
    model = init_empty_model(config, dtype=torch.bfloat16, device="cuda")
    tiny.randomize_weights(model)
    tokenizer = Tokenizer(tiny.byte_level_hf_tokenizer(),
                          extra_eos_token_ids=config.eos_token_ids)
    return LLM.from_engine(LLMEngine(model, tokenizer, config, EngineConfig(
        num_kv_blocks=num_kv_blocks, max_num_seqs=8, max_model_len=1024,
        max_num_batched_tokens=2048)))


@pytest.mark.gpu
@pytest.mark.parametrize("release", ["del", "shutdown"])
def test_releasing_an_llm_returns_the_device_memory(release):
    torch.cuda.synchronize()
    gc.collect()
    before = torch.cuda.memory_allocated()
    # 16384 blocks of 16 tokens x 2 layers x (K, V) x one KV head of 128 x bf16: 256 MiB.
    llm = _hopper_shaped_llm(16384)
    prompts = [[5 + i % 200 for i in range(300 + j)] for j in range(4)]
    llm.generate(prompts, SamplingParams(max_tokens=8), use_tqdm=False)
    assert torch.cuda.memory_allocated() - before >= 256 << 20
    if release == "shutdown":
        llm.shutdown()
    else:
        del llm
    gc.collect()
    # cuBLAS keeps a workspace per stream it ran on (the graphs' capture stream too): torch's,
    # not the engine's.
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    assert torch.cuda.memory_allocated() - before <= 8 << 20
