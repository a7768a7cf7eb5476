"""Decode graphs over narrower block tables: a bucket is captured again over a leading view of
the table only where the decode op would plan its launch differently (an fp8 cache splits
sequences of at most 2k tokens in two), and a step replays the narrowest view holding its
blocks."""

from __future__ import annotations

import pytest
import torch
from helpers.engines import make_engine

from mini_paged_attn.engine import LLM, SamplingParams
from mini_paged_attn.engine.config import EngineConfig
from mini_paged_attn.engine.worker.cuda_graphs import DecodeGraphs

HEADS = dict(num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096)


def _graphs(tiny_model_factory, kv_cache_dtype: str, max_model_len: int) -> DecodeGraphs:
    """The graphs an engine on the CPU would capture (nothing is captured here)."""
    from mini_paged_attn.engine import LLMEngine
    engine = LLMEngine.from_model(
        tiny_model_factory("llama", **HEADS), dtype="float16", device="cpu",
        config=EngineConfig(kv_cache_dtype=kv_cache_dtype, max_model_len=max_model_len,
                            max_num_seqs=64, cpu_kv_cache_bytes=1 << 22))
    runner = engine.runner
    # The engine's workspace (made on CUDA only): it caps the splits the plans may take.
    from mini_paged_attn.ops.attention import TRITON
    workspace = TRITON.decode_workspace(runner.attention_limits)
    return DecodeGraphs(runner.model, runner.kv_caches, runner.inputs, max_batch=64,
                        backend="triton", decode_workspace=workspace)


def _check_widths(graphs: DecodeGraphs) -> None:
    """Each bucket's widths: narrowest first, the full table last, each planned differently
    from the next wider one, and every halving left out planned as the next wider kept."""
    full = graphs.inputs.max_blocks_per_seq
    for b, widths in graphs.widths.items():
        assert widths == sorted(widths) and widths[-1] == full
        for narrow, wide in zip(widths, widths[1:]):
            assert graphs._plans(b, narrow) != graphs._plans(b, wide)
        width = 1 << ((full - 1).bit_length() - 1)
        while width >= 16:
            kept = next(w for w in widths if w >= width)
            if width not in widths:
                assert graphs._plans(b, width) == graphs._plans(b, kept)
            width //= 2


def test_fp8_buckets_of_enough_sequences_add_a_2k_table(tiny_model_factory):
    graphs = _graphs(tiny_model_factory, "fp8", 4096)
    full = graphs.inputs.max_blocks_per_seq
    assert full == 4096 // graphs.inputs.block_size
    _check_widths(graphs)
    # 8 KV heads: from 27 sequences the launch has enough programs (no length-dependent
    # split heuristic), and only short sequences (2048 tokens: 128 blocks of 16) split, in two.
    big = [b for b in graphs.buckets if b * 8 >= 0.8 * 264]
    assert big
    for b in big:
        assert graphs.widths[b] == [2048 // graphs.inputs.block_size, full], b


def test_other_backends_capture_the_full_table_only(tiny_model_factory):
    graphs = _graphs(tiny_model_factory, "fp8", 4096)
    graphs.backend = "torch"
    assert graphs._widths(64) == [graphs.inputs.max_blocks_per_seq]


def test_16_bit_caches_of_enough_sequences_capture_the_full_table_only(tiny_model_factory):
    graphs = _graphs(tiny_model_factory, "auto", 4096)
    _check_widths(graphs)
    for b, widths in graphs.widths.items():
        if b * 8 >= 0.8 * 264:
            assert widths == [graphs.inputs.max_blocks_per_seq], b


@pytest.mark.gpu
def test_fp8_graphs_over_narrow_tables_decode_like_eager_steps(tiny_model_factory):
    """Greedy decode replaying the narrow-table graphs gives the eager engine's tokens. 64
    sequences (512 programs, 3.9 a SM) taken longest first: short ones split in two, long ones
    not, so the bucket has a 2k table of its own."""
    model_dir = tiny_model_factory("llama", **HEADS)
    prompts = [[(7 * i + j) % 250 + 1 for j in range(5 + 3 * i)] for i in range(64)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = []
    for eager in (True, False):
        engine = make_engine(model_dir, kv_cache_dtype="fp8", backend="triton", device="cuda",
                             enforce_eager=eager, max_model_len=4096, max_num_seqs=64,
                             block_size=16, num_kv_blocks=2048)
        if not eager:
            assert len(engine.runner.graphs.widths[64]) == 2
        outputs = LLM.from_engine(engine).generate(prompts, params, use_tqdm=False)
        tokens.append([o.outputs[0].token_ids for o in outputs])
        del engine
        torch.cuda.empty_cache()
    assert tokens[0] == tokens[1]
