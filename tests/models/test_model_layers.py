"""RMSNorm, rope tables (default, linear, llama3) and apply_rotary against transformers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama import modeling_llama as hf_llama

from mini_paged_attn.models.attention import AttentionMetadata
from mini_paged_attn.models.config import RopeConfig
from mini_paged_attn.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rotary, rope_inv_freq

ROPES = {
    "default": RopeConfig(theta=10000.0),
    "linear": RopeConfig(theta=10000.0, rope_type="linear", factor=4.0),
    # original context 64 and head 16: the 8 pairs fall in all three llama3 bands
    "llama3": RopeConfig(theta=10000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                         high_freq_factor=4.0, original_max_position_embeddings=64),
}


def hf_rope(rope: RopeConfig, head_size: int = 16, max_positions: int = 512):
    # transformers 4.x spelling (rope_theta + rope_scaling), which 5.x converts
    scaling = None
    if rope.rope_type != "default":
        scaling = {"rope_type": rope.rope_type, "factor": rope.factor}
    if rope.rope_type == "llama3":
        scaling.update(low_freq_factor=rope.low_freq_factor, high_freq_factor=rope.high_freq_factor,
                       original_max_position_embeddings=rope.original_max_position_embeddings)
    config = LlamaConfig(hidden_size=4 * head_size, num_attention_heads=4, head_dim=head_size,
                         max_position_embeddings=max_positions, rope_theta=rope.theta,
                         rope_scaling=scaling)
    return hf_llama.LlamaRotaryEmbedding(config)


@pytest.mark.parametrize("name", list(ROPES))
def test_rope_inv_freq_matches_transformers(name):
    rope = ROPES[name]
    torch.testing.assert_close(rope_inv_freq(16, rope), hf_rope(rope).inv_freq, atol=0, rtol=1e-6)


def test_llama3_bands():
    """High frequencies untouched, low ones divided by factor, the middle strictly between."""
    rope = ROPES["llama3"]
    plain, scaled = rope_inv_freq(16, ROPES["default"]), rope_inv_freq(16, rope)
    ratio = plain / scaled
    assert ratio[0] == 1.0 and torch.allclose(ratio[-3:], torch.tensor(8.0))
    assert ((ratio[1:3] > 1) & (ratio[1:3] < 8)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["default", "llama3"])
def test_rotary_matches_transformers(name, dtype):
    rope = ROPES[name]
    gen = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 512, (9,), generator=gen)
    q = torch.randn(9, 4, 16, generator=gen).to(dtype)
    k = torch.randn(9, 2, 16, generator=gen).to(dtype)
    cos, sin = RotaryEmbedding(16, 512, rope, dtype=dtype)(positions)
    assert cos.shape == (9, 8) and cos.dtype == dtype
    hf_cos, hf_sin = hf_rope(rope)(q, positions[None])               # [1, 9, 16]
    ref_q, ref_k = hf_llama.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                 hf_cos, hf_sin)
    torch.testing.assert_close(apply_rotary(q, cos, sin), ref_q[0].transpose(0, 1), atol=0, rtol=0)
    torch.testing.assert_close(apply_rotary(k, cos, sin), ref_k[0].transpose(0, 1), atol=0, rtol=0)


def test_rotary_built_on_meta_then_reset():
    rope = ROPES["llama3"]
    with torch.device("meta"):
        meta = RotaryEmbedding(16, 64, rope, dtype=torch.float32)
    assert meta.cos_sin_cache.is_meta
    meta.to_empty(device="cpu")
    meta.reset_parameters()
    torch.testing.assert_close(meta.cos_sin_cache,
                               RotaryEmbedding(16, 64, rope, dtype=torch.float32).cos_sin_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers(dtype):
    gen = torch.Generator().manual_seed(1)
    x = (3 * torch.randn(5, 3, 32, generator=gen)).to(dtype)
    weight = (1 + 0.1 * torch.randn(32, generator=gen)).to(dtype)
    ours, ref = RMSNorm(32, 1e-6, dtype=dtype), hf_llama.LlamaRMSNorm(32, eps=1e-6).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(weight)
        ref.weight.copy_(weight)
        torch.testing.assert_close(ours(x), ref(x), atol=0, rtol=0)


def test_gated_mlp_matches_separate_projections():
    gen = torch.Generator().manual_seed(2)
    mlp = GatedMLP(16, 24, bias=True, dtype=torch.float32)
    x = torch.randn(7, 16, generator=gen)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
        w, b = mlp.gate_up_proj.weight, mlp.gate_up_proj.bias
        gate, up = x @ w[:24].T + b[:24], x @ w[24:].T + b[24:]
        ref = (torch.nn.functional.silu(gate) * up) @ mlp.down_proj.weight.T + mlp.down_proj.bias
        torch.testing.assert_close(mlp(x), ref, atol=1e-5, rtol=1e-5)


def test_attention_metadata_for_step_keeps_the_workspace_and_order_for_decode_only():
    def step(q_lens):
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        return SimpleNamespace(slot_mapping=torch.arange(int(cu[-1])), cu_seqlens_q=cu,
                               context_lens=torch.tensor(q_lens, dtype=torch.int32),
                               block_tables=torch.zeros(len(q_lens), 4, dtype=torch.int32),
                               max_seqlen_q=max(q_lens), no_prefix=True,
                               seq_order=torch.tensor([1, 0], dtype=torch.int32), cascade=None)

    workspace = torch.zeros(8)
    decode_step = step([1, 1])
    decode = AttentionMetadata.for_step(decode_step, decode_only=True, backend="torch",
                                        decode_workspace=workspace)
    assert decode.decode_workspace is workspace and decode.num_seqs == decode.num_tokens == 2
    assert decode.seq_order is decode_step.seq_order
    prefill = AttentionMetadata.for_step(step([3, 1]), decode_only=False, backend="torch",
                                         decode_workspace=workspace)
    assert prefill.decode_workspace is None and prefill.num_tokens == 4 and prefill.no_prefix
    assert prefill.seq_order is None


@pytest.mark.parametrize("seq_order, decode_only", [
    (torch.tensor([1, 0]), True),                      # int64
    (torch.tensor([0], dtype=torch.int32), True),      # one row for two
    (torch.tensor([1, 0], dtype=torch.int32), False),  # not a decode step
])
def test_attention_metadata_refuses_a_bad_seq_order(seq_order, decode_only):
    q_lens = [1, 1] if decode_only else [3, 1]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    with pytest.raises(ValueError, match="^seq_order"):
        AttentionMetadata(slot_mapping=torch.arange(int(cu[-1])), cu_seqlens_q=cu,
                          context_lens=torch.tensor(q_lens, dtype=torch.int32),
                          block_tables=torch.zeros(2, 4, dtype=torch.int32),
                          max_seqlen_q=max(q_lens), decode_only=decode_only,
                          seq_order=seq_order)
