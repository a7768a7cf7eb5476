"""The attention layer's variant options (sliding window, soft-cap, sinks) reach the ops."""

from __future__ import annotations

import pytest
import torch

from helpers.paged_batch import make_decode_batch, make_prefill_batch
from mini_paged_attn.models.attention import Attention, AttentionMetadata, paged_attention
from mini_paged_attn.models.config import ModelConfig, RopeConfig
from mini_paged_attn.ops.dispatch import paged_decode, paged_prefill


def _config() -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", num_layers=1, hidden_size=32,
                       intermediate_size=64, num_q_heads=4, num_kv_heads=2, head_size=8,
                       vocab_size=16, max_position_embeddings=64, rms_norm_eps=1e-6,
                       rope=RopeConfig(theta=10000.0))


def test_sinks_parameter_is_float32_per_query_head():
    layer = Attention(_config(), dtype=torch.float16, window_size=(4, -1), softcap=30.0,
                      sinks=True)
    assert layer.sinks.dtype == torch.float32 and tuple(layer.sinks.shape) == (4,)
    assert "sinks" in dict(layer.named_parameters())
    assert layer.window_size == (4, -1) and layer.softcap == 30.0
    assert Attention(_config(), dtype=torch.float16).sinks is None


@pytest.mark.parametrize("kwargs, name", [(dict(window_size=(-3, 0)), "window_size"),
                                          (dict(softcap=-1.0), "softcap"),
                                          (dict(sinks=1), "sinks")])
def test_bad_options_raise_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        Attention(_config(), dtype=torch.float32, **kwargs)


def _meta(batch, decode_only: bool) -> AttentionMetadata:
    # No new tokens to store: slot -1 skips each row's write, the cache already holds them.
    return AttentionMetadata(
        slot_mapping=torch.full((batch.query.shape[0],), -1, dtype=torch.int64),
        cu_seqlens_q=batch.cu_seqlens_q, context_lens=batch.context_lens,
        block_tables=batch.block_tables,
        max_seqlen_q=int((batch.cu_seqlens_q[1:] - batch.cu_seqlens_q[:-1]).max()),
        decode_only=decode_only, backend="torch")


@pytest.mark.parametrize("decode_only", [True, False])
def test_paged_attention_passes_the_variant_to_the_ops(decode_only):
    make = make_decode_batch if decode_only else (
        lambda lens, **kw: make_prefill_batch([3] * len(lens), lens, **kw))
    batch = make([5, 20], num_q_heads=4, num_kv_heads=2, head_size=8, block_size=4, seed=1)
    k = v = torch.zeros(batch.query.shape[0], 2, 8)
    variant = dict(window_size=(3, -1), softcap=2.0, sinks=torch.tensor([0.5, -1.0, 2.0, 0.0]))
    got = paged_attention(batch.query, k, v, (batch.key_cache, batch.value_cache),
                          _meta(batch, decode_only), 0.3, **variant)
    if decode_only:
        want = paged_decode(*batch.decode_args, scale=0.3, backend="torch", **variant)
    else:
        want = paged_prefill(*batch.prefill_args, scale=0.3, backend="torch", **variant)
    plain = paged_attention(batch.query, k, v, (batch.key_cache, batch.value_cache),
                            _meta(batch, decode_only), 0.3)
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, plain)
