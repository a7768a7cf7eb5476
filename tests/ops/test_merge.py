"""merge_attention_states: attention over A ∪ B from attention over A and over B."""

from __future__ import annotations

import pytest
import torch

from mini_paged_attn.ops import merge_attention_states, paged_decode, reference

NEG_INF = float("-inf")


def attention(q, k, v, scale):
    """float64 attention of q [H, D] over k, v [N, H, D]: (out [H, D], lse [H])."""
    scores = torch.einsum("hd,nhd->hn", q.double(), k.double()) * scale
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), v.double())
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_merging_two_key_sets_gives_attention_over_both(dtype):
    gen = torch.Generator().manual_seed(0)
    heads, d, n = 4, 16, 40
    q, k, v = (torch.randn(*shape, generator=gen) for shape in ((heads, d), (n, heads, d),
                                                                 (n, heads, d)))
    # Scale so the two halves have very different mass (lse ~ tens apart for some heads).
    k[:20] *= 4
    side = torch.randperm(n, generator=gen) < 17  # a random partition of the keys
    out_a, lse_a = attention(q, k[side], v[side], 0.5)
    out_b, lse_b = attention(q, k[~side], v[~side], 0.5)
    want_out, want_lse = attention(q, k, v, 0.5)
    out, lse = merge_attention_states(out_a.to(dtype), lse_a.float(), out_b.to(dtype),
                                      lse_b.float())
    assert out.dtype == dtype and lse.dtype == torch.float32
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(out.double(), want_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-6)
    # The combine is symmetric.
    out2, lse2 = merge_attention_states(out_b.to(dtype), lse_b.float(), out_a.to(dtype),
                                        lse_a.float())
    torch.testing.assert_close(out2, out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse2, lse)


def test_split_kv_decode_is_the_merge_of_its_halves():
    """Split each sequence's blocks in two tables, decode both, merge: the full decode."""
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, hkv, hq, d = 12, 4, 2, 6, 8
    key_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen)
    value_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen)[:10].view(2, 5).to(torch.int32)
    lens = torch.tensor([18, 7], dtype=torch.int32)
    query = torch.randn(2, hq, d, generator=gen)
    full, full_lse = paged_decode(query, key_cache, value_cache, tables, lens, return_lse=True,
                                  backend="torch")
    # First part: blocks [0, 2) (8 tokens, fewer if shorter); second: the rest.
    first = torch.clamp(lens, max=8)
    out_a, lse_a = paged_decode(query, key_cache, value_cache, tables[:, :2].contiguous(), first,
                                return_lse=True, backend="torch")
    out_b, lse_b = paged_decode(query, key_cache, value_cache, tables[:, 2:].contiguous(),
                                lens - first, return_lse=True, backend="torch")
    out, lse = merge_attention_states(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out, full, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse, full_lse, atol=1e-6, rtol=1e-6)


def test_seed_004_combine_without_exp_is_wrong():
    """Seed 004 weighs by (M - M_new) instead of exp(M - M_new); the real combine differs."""
    out_a, out_b = torch.ones(1, 1, 4), torch.full((1, 1, 4), 3.0)
    lse_a, lse_b = torch.tensor([[0.0]]), torch.tensor([[1.0]])
    out, lse = merge_attention_states(out_a, lse_a, out_b, lse_b)
    w_a = 1 / (1 + torch.e)  # exp(0) / (exp(0) + exp(1))
    torch.testing.assert_close(out, w_a * out_a + (1 - w_a) * out_b)
    torch.testing.assert_close(lse, torch.log(1 + torch.exp(torch.tensor([[1.0]]))))
    # The seed's formula: sum((M - M_new) * (L / L_new) * O) with L = exp(lse) per side.
    m_new, l_new = 1.0, 1 + torch.e
    seed = (0 - m_new) * (1 / l_new) * out_a + (1 - m_new) * (torch.e / l_new) * out_b
    assert not torch.allclose(seed, out)


def test_empty_side_contributes_nothing_even_if_nan():
    gen = torch.Generator().manual_seed(2)
    out_a = torch.randn(3, 2, 8, generator=gen)
    lse_a = torch.randn(3, 2, generator=gen)
    lse_a[1, 0] = NEG_INF  # row 1 head 0: both sides empty
    empty_out = torch.full_like(out_a, float("nan"))  # whatever an empty side holds
    empty_lse = torch.full_like(lse_a, NEG_INF)
    for out, lse in (merge_attention_states(out_a, lse_a, empty_out, empty_lse),
                     merge_attention_states(empty_out, empty_lse, out_a, lse_a)):
        assert torch.equal(lse, lse_a)
        keep = lse_a != NEG_INF
        assert torch.equal(out[keep], out_a[keep])
        assert torch.equal(out[1, 0], torch.zeros(8))  # both empty: zeros, lse -inf
        assert not out.isnan().any()


def test_far_apart_lse_does_not_overflow():
    out_a, out_b = torch.ones(1, 4), torch.full((1, 4), 2.0)
    out, lse = merge_attention_states(out_a, torch.tensor([1000.0]), out_b, torch.tensor([0.0]))
    assert torch.equal(out, out_a) and torch.equal(lse, torch.tensor([1000.0]))
    out, lse = merge_attention_states(out_a, torch.tensor([-1000.0]), out_b,
                                      torch.tensor([-1000.0]))
    torch.testing.assert_close(out, torch.full((1, 4), 1.5))
    torch.testing.assert_close(lse, torch.tensor([-1000.0 + 0.6931472]))


@pytest.mark.parametrize("case, name", [
    ("out_b shape", "out_b"), ("out_b dtype", "out_b"), ("lse_a shape", "lse_a"),
    ("lse_b dtype", "lse_b"), ("out_a 1-D", "out_a"), ("out_a int", "out_a"),
    ("lse device", "lse_a"),
])
def test_bad_arguments_raise_value_error_naming_them(case, name):
    out, lse = torch.zeros(2, 3, 4), torch.zeros(2, 3)
    args = {"out_a": out, "lse_a": lse, "out_b": out.clone(), "lse_b": lse.clone()}
    if case == "out_b shape":
        args["out_b"] = torch.zeros(2, 3, 5)
    elif case == "out_b dtype":
        args["out_b"] = out.half()
    elif case == "lse_a shape":
        args["lse_a"] = torch.zeros(2, 4)
    elif case == "lse_b dtype":
        args["lse_b"] = lse.half()
    elif case == "out_a 1-D":
        args["out_a"] = torch.zeros(4)
    elif case == "out_a int":
        args["out_a"] = out.int()
    elif case == "lse device":
        args["lse_a"] = lse.to("meta")
    with pytest.raises(ValueError, match=f"^{name}:"):
        merge_attention_states(**args)


def test_reference_lse_is_what_merge_expects():
    """The lse of the reference ops is the natural log-sum-exp of the *scaled* scores."""
    gen = torch.Generator().manual_seed(3)
    key_cache = torch.randn(2, 4, 1, 8, generator=gen)
    tables = torch.tensor([[1, 0]], dtype=torch.int32)
    q = torch.randn(1, 1, 8, generator=gen)
    _, lse = reference.paged_decode_gather(q, key_cache, key_cache, tables,
                                           torch.tensor([6], dtype=torch.int32), scale=0.3)
    keys = torch.cat([key_cache[1], key_cache[0]])[:6, 0]  # [6, D]
    torch.testing.assert_close(lse[0, 0], torch.logsumexp(keys @ q[0, 0] * 0.3, 0))
