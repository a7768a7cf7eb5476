"""The attention function alone against torch SDPA: shapes, padding holes, decode, GQA, errors."""

import pytest
import torch

from mini_paged_attn.integrations.hf_attention import mini_paged_attention_forward


class _Layer(torch.nn.Module):
    is_causal = True


def _sdpa_reference(q, k, v, keep, scale):
    """SDPA over the padded rows: causal (bottom-right) and padding mask; [batch, q_len, heads, d]."""
    q_len, kv_len = q.shape[2], k.shape[2]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    pos_q = torch.arange(kv_len - q_len, kv_len)[:, None]
    allowed = pos_q >= torch.arange(kv_len)[None, :]               # [q_len, kv_len]
    if keep is not None:
        allowed = allowed[None] & keep[:, None, :]                  # [batch, q_len, kv_len]
        allowed = allowed[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    return out.transpose(1, 2)


@pytest.mark.parametrize("q_len,kv_len", [(7, 7), (1, 9), (3, 10)])
@pytest.mark.parametrize("padded", [False, True])
def test_matches_sdpa(q_len, kv_len, padded):
    gen = torch.Generator().manual_seed(q_len * 100 + kv_len)
    batch, heads, kv_heads, d = 3, 4, 2, 16
    q = torch.randn(batch, heads, q_len, d, generator=gen)
    k = torch.randn(batch, kv_heads, kv_len, d, generator=gen)
    v = torch.randn(batch, kv_heads, kv_len, d, generator=gen)
    keep = None
    if padded:
        keep = torch.ones(batch, kv_len, dtype=torch.bool)
        keep[1, :2] = False                     # left padding
        keep[2, 1] = False                      # a hole in the cached prefix
        keep[2, -1] = q_len > 1                 # the newest token of a row padded (prefill only)
    out, weights = mini_paged_attention_forward(_Layer(), q, k, v, keep, scaling=0.3)
    assert weights is None and out.shape == (batch, q_len, heads, d) and out.is_contiguous()
    ref = _sdpa_reference(q, k, v, keep, 0.3)
    real_q = torch.ones(batch, q_len, dtype=torch.bool) if keep is None else keep[:, kv_len - q_len:]
    torch.testing.assert_close(out[real_q], ref[real_q], atol=1e-5, rtol=1e-5)
    assert not out[~real_q].any()           # padded queries give 0


def test_non_causal_module():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 5, 8, generator=gen) for _ in range(3))
    layer = _Layer()
    layer.is_causal = False
    out, _ = mini_paged_attention_forward(layer, q, k, v, None)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kwargs,match", [
    ({"dropout": 0.1}, "dropout"),
    ({"position_bias": torch.zeros(1)}, "position_bias"),
])
def test_unsupported_features_raise(kwargs, match):
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    with pytest.raises(NotImplementedError, match=match):
        mini_paged_attention_forward(_Layer(), q, k, v, None, **kwargs)


def _eager_variant(q, k, v, keep, scale, window, softcap, sinks):
    """gpt-oss / Gemma 2 style eager attention: window mask, soft-capped logits, a sink column
    dropped after the softmax; [batch, q_len, heads, d]."""
    q_len, kv_len = q.shape[2], k.shape[2]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    logits = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    # Real-token positions: a window counts real keys, as the packed varlen rows do.
    real = torch.ones(q.shape[0], kv_len, dtype=torch.bool) if keep is None else keep
    rank = real.cumsum(1) - 1                                        # [batch, kv_len]
    pos_q = rank[:, kv_len - q_len:]                                 # [batch, q_len]
    allowed = (rank[:, None, :] <= pos_q[:, :, None]) & real[:, None, :]
    if window is not None:
        allowed &= rank[:, None, :] > pos_q[:, :, None] - window
    logits = logits.masked_fill(~allowed[:, None], float("-inf"))
    if sinks is not None:
        sink = sinks.view(1, -1, 1, 1).expand(*logits.shape[:3], 1)
        logits = torch.cat([logits, sink], dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., :kv_len]
    return (probs @ v).transpose(1, 2)


@pytest.mark.parametrize("q_len,kv_len", [(7, 7), (1, 9)])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("window,softcap,sinks", [(3, None, False), (None, 2.0, False),
                                                  (None, None, True), (4, 1.5, True)])
def test_window_softcap_and_sinks_match_eager(q_len, kv_len, padded, window, softcap, sinks):
    gen = torch.Generator().manual_seed(q_len + kv_len)
    q = torch.randn(2, 4, q_len, 16, generator=gen) * 3
    k = torch.randn(2, 2, kv_len, 16, generator=gen)
    v = torch.randn(2, 2, kv_len, 16, generator=gen)
    keep = None
    if padded:
        keep = torch.ones(2, kv_len, dtype=torch.bool)
        keep[1, :3] = False
    s_aux = torch.randn(4, generator=gen) if sinks else None
    out, _ = mini_paged_attention_forward(_Layer(), q, k, v, keep, scaling=0.3,
                                          sliding_window=window, softcap=softcap, s_aux=s_aux)
    ref = _eager_variant(q, k, v, keep, 0.3, window, softcap, s_aux)
    real_q = torch.ones(2, q_len, dtype=torch.bool) if keep is None else keep[:, kv_len - q_len:]
    torch.testing.assert_close(out[real_q], ref[real_q], atol=1e-5, rtol=1e-5)


def test_module_sinks_are_used_without_s_aux():
    layer = _Layer()
    layer.sinks = torch.nn.Parameter(torch.tensor([3.0, -1.0]))
    q, k, v = (torch.randn(1, 2, 5, 8, generator=torch.Generator().manual_seed(i))
               for i in range(3))
    out, _ = mini_paged_attention_forward(layer, q, k, v, None)
    ref = _eager_variant(q, k, v, None, 8 ** -0.5, None, None, layer.sinks.detach())
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [0, -2, 2.5, True])
def test_bad_sliding_window_raises(window):
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    with pytest.raises(ValueError, match="sliding_window"):
        mini_paged_attention_forward(_Layer(), q, k, v, None, sliding_window=window)


def test_window_covering_all_keys_runs():
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    out, _ = mini_paged_attention_forward(_Layer(), q, k, v, None, sliding_window=6)
    torch.testing.assert_close(out, _sdpa_reference(q, k, v, None, 8 ** -0.5), atol=1e-5, rtol=1e-5)


def test_masks_we_do_not_take():
    q, k, v = (torch.randn(2, 2, 4, 8) for _ in range(3))
    with pytest.raises(NotImplementedError, match="4D attention mask"):
        mini_paged_attention_forward(_Layer(), q, k, v, torch.zeros(2, 1, 4, 4))
    with pytest.raises(ValueError, match=r"\[batch, kv_len\]"):
        mini_paged_attention_forward(_Layer(), q, k, v, torch.ones(2, 9, dtype=torch.bool))
