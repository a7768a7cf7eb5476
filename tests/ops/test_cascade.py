"""cascade_attention: shared prefixes attended once per group, merged with each suffix, equal
to plain paged attention over prefix + suffix."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from helpers.fp8_batch import per_head_scales
from helpers.paged_batch import paginate
from mini_paged_attn.ops import cascade_attention, paged_decode, paged_prefill
from mini_paged_attn.ops.kv_quant import FP8_DTYPE, quantize

BACKENDS = ["torch", "triton"]
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-2, rtol=1e-2)}
HEADS = {"gqa": (8, 2), "mha": (4, 4), "mqa": (4, 1)}
HEAD_SIZE = 16


@dataclasses.dataclass
class Case:
    """One cascade call's arguments and the plain call over the concatenated K/V."""

    query: torch.Tensor
    cascade: dict            # cascade_attention's arguments but the query
    plain: tuple             # (key_cache, value_cache, block_tables, cu_seqlens_q, context_lens)

    def run(self, **kwargs) -> torch.Tensor:
        return cascade_attention(self.query, **self.cascade, **kwargs)

    def want(self, *, backend: str, **kwargs) -> torch.Tensor:
        kc, vc, table, cu, lens = self.plain
        if self.cascade["decode_only"]:
            return paged_decode(self.query, kc, vc, table, lens, backend=backend, **kwargs)
        return paged_prefill(self.query, kc, vc, table, cu, lens, causal=True, backend=backend,
                             **kwargs)


def make_case(*, seed: int, prefix_lens: list[int], group_sizes: list[int],
              suffix_lens: list[int], decode_only: bool, heads=(8, 2), block_size: int = 4,
              dtype=torch.float32, fp8_scales=None, head_size: int = HEAD_SIZE) -> Case:
    """Sequences ``0 .. len(suffix_lens) - 1``; group g holds ``group_sizes[g]`` of them, drawn
    at random (the rest are ungrouped), with a prefix of ``prefix_lens[g]`` tokens. Prefixes and
    suffixes share one pool of shuffled, NaN-poisoned blocks; the plain call reads a second
    pool holding each sequence's prefix + suffix."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_q_heads, num_kv_heads = heads
    num_seqs = len(suffix_lens)
    order = list(range(num_seqs))
    rng.shuffle(order)
    members, start = [], 0
    for size in group_sizes:
        members.append(sorted(order[start:start + size], key=lambda _: rng.random()))
        start += size
    assert start <= num_seqs

    cache_dtype = dtype if fp8_scales is None else torch.float32

    def kv(n):
        return torch.randn(n, 2, num_kv_heads, head_size, generator=gen).to(cache_dtype)

    prefixes = [kv(n) for n in prefix_lens]
    suffixes = [kv(n) for n in suffix_lens]
    group_of = {s: g for g, seqs in enumerate(members) for s in seqs}
    full = [torch.cat(([prefixes[group_of[i]]] if i in group_of else []) + [suffixes[i]])
            for i in range(num_seqs)]

    def pool(seqs):
        kc, vc, table = paginate([x[:, 0] for x in seqs], [x[:, 1] for x in seqs], block_size,
                                 head_shape=(num_kv_heads, head_size), dtype=cache_dtype,
                                 gen=gen)
        if fp8_scales is not None:  # same values in both pools: each token quantized alike
            kc, vc = quantize(kc, fp8_scales[0]), quantize(vc, fp8_scales[1])
            assert kc.dtype == FP8_DTYPE
        return kc, vc, table

    kc, vc, tables = pool(prefixes + suffixes)
    g = len(prefix_lens)
    q_lens = ([1] * num_seqs if decode_only
              else [rng.randint(1, max(n, 1)) if n else 0 for n in suffix_lens])
    cu = torch.zeros(num_seqs + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    rows = [list(range(cu[i], cu[i + 1])) for i in range(num_seqs)]
    group_tokens = [r for seqs in members for s in seqs for r in rows[s]]
    cu_group = [0]
    for seqs in members:
        cu_group.append(cu_group[-1] + sum(q_lens[s] for s in seqs))
    query = torch.randn(int(cu[-1]), num_q_heads, head_size, generator=gen).to(dtype)
    fkc, fvc, ftable = pool(full)
    cascade = dict(
        key_cache=kc, value_cache=vc, cu_seqlens_q=cu,
        prefix_block_tables=tables[:g].contiguous(),
        prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32),
        cu_group_tokens=torch.tensor(cu_group, dtype=torch.int32),
        group_tokens=torch.tensor(group_tokens, dtype=torch.int32),
        suffix_block_tables=tables[g:].contiguous(),
        suffix_lens=torch.tensor(suffix_lens, dtype=torch.int32), decode_only=decode_only)
    lens = torch.tensor([x.shape[0] for x in full], dtype=torch.int32)
    return Case(query, cascade, (fkc, fvc, ftable, cu, lens))


def random_case(seed: int, *, block_size: int = 4, **kwargs) -> Case:
    """1-3 groups of 1-5 sequences, prefixes of 0 .. a few blocks, suffixes of 1 and
    block_size +- 1 tokens, a few ungrouped sequences beside them."""
    rng = random.Random(1000 + seed)
    sizes = [rng.randint(1, 5) for _ in range(rng.randint(1, 3))]
    num_seqs = sum(sizes) + rng.randint(0, 2)
    prefix_choices = [0, block_size - 1, block_size, block_size + 1, 3 * block_size + 2]
    suffix_choices = [1, block_size - 1, block_size + 1]
    return make_case(seed=seed, prefix_lens=[rng.choice(prefix_choices) for _ in sizes],
                     group_sizes=sizes,
                     suffix_lens=[rng.choice(suffix_choices) for _ in range(num_seqs)],
                     block_size=block_size, **kwargs)


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("decode_only", [True, False], ids=["decode", "prefill"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_plain_attention_over_prefix_and_suffix(backend, dtype, decode_only, heads):
    for seed in range(2):
        case = random_case(seed, decode_only=decode_only, heads=HEADS[heads], dtype=dtype)
        got = case.run(backend=backend)
        assert got.dtype == dtype and got.shape == case.query.shape
        torch.testing.assert_close(got, case.want(backend=backend), **TOL[dtype])


@pytest.mark.parametrize("prefix_len", [0, 3, 4, 5, 13])
@pytest.mark.parametrize("decode_only", [True, False], ids=["decode", "prefill"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_prefix_lengths_around_block_edges(backend, decode_only, prefix_len):
    case = make_case(seed=prefix_len, prefix_lens=[prefix_len, 6], group_sizes=[3, 1],
                     suffix_lens=[1, 3, 5, 4, 2], decode_only=decode_only)
    torch.testing.assert_close(case.run(backend=backend), case.want(backend=backend),
                               **TOL[torch.float32])


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_suffix_of_zero_keys_sees_its_prefix_only(backend):
    # Sequence 1 (grouped) has no own key; sequence 2 (grouped, empty prefix) none either.
    case = make_case(seed=3, prefix_lens=[6, 0], group_sizes=[2, 1], suffix_lens=[2, 0, 0],
                     decode_only=True)
    got = case.run(backend=backend)
    assert not got.isnan().any()
    torch.testing.assert_close(got, case.want(backend=backend), **TOL[torch.float32])


@pytest.mark.parametrize("decode_only", [True, False], ids=["decode", "prefill"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_softcap_and_sinks(backend, decode_only):
    case = random_case(4, decode_only=decode_only)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(5)) * 2
    for options in (dict(softcap=2.5), dict(sinks=sinks), dict(softcap=2.5, sinks=sinks)):
        torch.testing.assert_close(case.run(backend=backend, **options),
                                   case.want(backend=backend, **options), **TOL[torch.float32])


@pytest.mark.parametrize("backend", BACKENDS)
def test_sinks_with_a_suffix_of_zero_keys_count_once(backend):
    case = make_case(seed=6, prefix_lens=[5], group_sizes=[2], suffix_lens=[0, 3, 1],
                     decode_only=True)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.0, -3.0, 0.25, 4.0])
    torch.testing.assert_close(case.run(backend=backend, sinks=sinks),
                               case.want(backend=backend, sinks=sinks), **TOL[torch.float32])


@pytest.mark.parametrize("decode_only", [True, False], ids=["decode", "prefill"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_cache(backend, decode_only):
    scales = (per_head_scales(2, "cpu"), per_head_scales(2, "cpu", base=0.02))
    case = random_case(7, decode_only=decode_only, dtype=torch.float16, fp8_scales=scales)
    kwargs = dict(k_scale=scales[0], v_scale=scales[1])
    torch.testing.assert_close(case.run(backend=backend, **kwargs),
                               case.want(backend=backend, **kwargs), **TOL[torch.float16])


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_groups_is_plain_attention(backend):
    case = make_case(seed=8, prefix_lens=[], group_sizes=[], suffix_lens=[3, 5],
                     decode_only=False)
    torch.testing.assert_close(case.run(backend=backend), case.want(backend=backend),
                               **TOL[torch.float32])


@pytest.mark.parametrize("backend", BACKENDS)
def test_writes_into_out_and_takes_scale(backend):
    case = random_case(9, decode_only=True)
    out = torch.full_like(case.query, float("nan"))
    got = case.run(backend=backend, out=out, scale=0.3)
    assert got is out
    torch.testing.assert_close(out, case.want(backend=backend, scale=0.3),
                               **TOL[torch.float32])


def test_decode_options_reach_the_suffix_decode():
    case = random_case(10, decode_only=True)
    n = case.query.shape[0]
    order = torch.arange(n - 1, -1, -1, dtype=torch.int32)
    got = case.run(backend="triton", seq_order=order, num_splits=2)
    torch.testing.assert_close(got, case.want(backend="triton"), **TOL[torch.float32])


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_causal_prefill_takes_more_query_rows_than_keys(backend):
    # The packed prefix call has T * gs rows over a prefix that may be shorter (or empty):
    # a non-causal row sees every key wherever it sits.
    gen = torch.Generator().manual_seed(17)
    keys = [torch.randn(n, 2, 16, generator=gen) for n in (3, 0, 9)]
    values = [torch.randn(n, 2, 16, generator=gen) for n in (3, 0, 9)]
    kc, vc, table = paginate(keys, values, 4, head_shape=(2, 16), dtype=torch.float32, gen=gen)
    q_lens = (7, 2, 12)
    query = torch.randn(sum(q_lens), 2, 16, generator=gen)
    cu = torch.tensor([0, 7, 9, 21], dtype=torch.int32)
    out, lse = paged_prefill(query, kc, vc, table, cu, _int32(3, 0, 9), causal=False,
                             return_lse=True, backend=backend)
    for i, (k, v) in enumerate(zip(keys, values)):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        if k.shape[0] == 0:
            assert (out[rows] == 0).all() and (lse[rows] == float("-inf")).all()
            continue
        scores = torch.einsum("thd,khd->thk", query[rows], k) * 16 ** -0.5
        want = torch.einsum("thk,khd->thd", scores.softmax(-1), v)
        torch.testing.assert_close(out[rows], want, **TOL[torch.float32])
        torch.testing.assert_close(lse[rows], scores.logsumexp(-1), **TOL[torch.float32])
    with pytest.raises(ValueError, match="cu_seqlens_q: expected q_len <= context_lens"):
        paged_prefill(query, kc, vc, table, cu, _int32(3, 0, 9), causal=True, backend="torch")


def _bad(name: str, value):
    return pytest.param(name, value, id=name)


def _int32(*values):
    return torch.tensor(values, dtype=torch.int32)


BAD_ARGS = [
    _bad("query", torch.zeros(4, 8, 16, dtype=torch.int32)),
    _bad("key_cache", torch.zeros(3, 4, 2, 8)),
    _bad("cu_seqlens_q", _int32(0, 1)),
    _bad("prefix_block_tables", torch.zeros(5, 4, dtype=torch.int32)),
    _bad("prefix_lens", torch.zeros(1, dtype=torch.int64)),
    _bad("cu_group_tokens", _int32(0)),
    _bad("group_tokens", torch.zeros(99, dtype=torch.int32)),
    _bad("suffix_block_tables", torch.zeros(2, 4, dtype=torch.int32)),
    _bad("suffix_lens", torch.zeros(2, 1, dtype=torch.int32)),
    _bad("decode_only", 1),
    _bad("scale", -1.0),
    _bad("out", torch.zeros(1, 8, 16)),
    _bad("k_scale", torch.ones(())),
    _bad("softcap", -1.0),
    _bad("sinks", torch.zeros(3)),
    _bad("seq_order", torch.zeros(2, dtype=torch.int32)),
    _bad("backend", "cuda"),
]


@pytest.mark.parametrize("name, value", BAD_ARGS)
def test_bad_arguments_name_themselves(name, value):
    case = random_case(11, decode_only=True)
    kwargs = dict(case.cascade, query=case.query, out=torch.full_like(case.query, 7.0))
    before = kwargs["out"].clone()
    kwargs[name] = value
    with pytest.raises(ValueError, match=name):
        cascade_attention(**kwargs)
    if name != "out":
        assert torch.equal(kwargs["out"], before)


@pytest.mark.parametrize("name", ["seq_order", "workspace", "num_splits"])
def test_decode_options_need_decode_only(name):
    case = random_case(12, decode_only=False)
    value = {"seq_order": _int32(0), "workspace": torch.zeros(8), "num_splits": 2}[name]
    with pytest.raises(ValueError, match=f"{name}: expected None unless decode_only"):
        case.run(backend="torch", **{name: value})


def test_decode_only_needs_one_row_per_sequence():
    case = random_case(13, decode_only=False)
    case.cascade["decode_only"] = True
    if case.query.shape[0] == case.cascade["suffix_lens"].shape[0]:
        pytest.skip("this draw has one row per sequence")
    with pytest.raises(ValueError, match="query: expected one row per sequence"):
        case.run(backend="torch")


def _values(case: Case, name: str) -> torch.Tensor:
    t = case.cascade[name].clone()
    if name == "group_tokens":
        t[0] = case.query.shape[0]          # past the last query row
    elif name == "cu_group_tokens":
        t[-1] += 1                          # past num_grouped_tokens
    elif name == "prefix_lens":
        t[0] = case.cascade["prefix_block_tables"].shape[1] * 4 + 1
    elif name == "prefix_block_tables":
        t[0, 0] = case.cascade["key_cache"].shape[0]
    elif name == "suffix_lens":
        t[0] = -1
    return t


@pytest.mark.parametrize("name", ["group_tokens", "cu_group_tokens", "prefix_lens",
                                  "prefix_block_tables", "suffix_lens"])
def test_torch_backend_checks_values_before_writing(name):
    case = make_case(seed=14, prefix_lens=[6], group_sizes=[2], suffix_lens=[2, 3, 1],
                     decode_only=True)
    case.cascade[name] = _values(case, name)
    out = torch.full_like(case.query, 7.0)
    with pytest.raises(ValueError, match=name):
        case.run(backend="torch", out=out)
    assert (out == 7.0).all()


def test_group_rows_listed_twice_are_refused():
    case = make_case(seed=15, prefix_lens=[6], group_sizes=[2], suffix_lens=[2, 3, 1],
                     decode_only=True)
    case.cascade["group_tokens"] = _int32(0, 0)
    with pytest.raises(ValueError, match="group_tokens: expected each query row listed once"):
        case.run(backend="torch")


@pytest.mark.gpu
def test_gpu_bf16_decode_two_groups_of_32_with_a_1k_prefix():
    gen = torch.Generator().manual_seed(16)
    hq, hkv, d, bs = 32, 8, 128, 16
    dev = torch.device("cuda")
    prefix = [1024, 1000]
    suffix = [int(x) for x in torch.randint(1, 300, (64,), generator=gen)]
    case = make_case(seed=16, prefix_lens=prefix, group_sizes=[32, 32], suffix_lens=suffix,
                     decode_only=True, heads=(hq, hkv), block_size=bs, head_size=d)
    case = _to(case, dev, torch.bfloat16)
    got = case.run(backend="triton")
    want = case.want(backend="triton")
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("decode_only", [True, False], ids=["decode", "prefill"])
def test_gpu_bf16_head_128_one_big_group_and_prefill_rows(decode_only):
    # 256 decode rows of one group pack into 1024 prefix rows (the paths a long prefill
    # takes on the device: page copy, Hopper); prefill rows of up to 40 tokens beside it.
    if decode_only:
        case = make_case(seed=18, prefix_lens=[2048], group_sizes=[256], suffix_lens=[33] * 256,
                         decode_only=True, heads=(32, 8), block_size=16, head_size=128)
    else:
        case = make_case(seed=19, prefix_lens=[512, 96], group_sizes=[6, 3],
                         suffix_lens=[40, 17, 1, 16, 33, 2, 5, 24, 9, 31], decode_only=False,
                         heads=(32, 8), block_size=16, head_size=128)
    case = _to(case, torch.device("cuda"), torch.bfloat16)
    torch.testing.assert_close(case.run(backend="triton").float(),
                               case.want(backend="triton").float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_decode_step_is_captured_in_a_cuda_graph():
    from helpers.cuda_graphs import capture
    case = make_case(seed=20, prefix_lens=[256, 64], group_sizes=[8, 4],
                     suffix_lens=[int(n) for n in torch.arange(14) * 7 + 1], decode_only=True,
                     heads=(32, 8), block_size=16, head_size=128)
    case = _to(case, torch.device("cuda"), torch.bfloat16)
    out = torch.empty_like(case.query)
    graph, _ = capture(lambda: case.run(backend="triton", out=out))
    case.query.copy_(torch.randn_like(case.query))
    graph.replay()
    torch.testing.assert_close(out.float(), case.want(backend="triton").float(), atol=2e-2,
                               rtol=2e-2)


def _to(case: Case, device, dtype) -> Case:
    """``case`` on ``device``, its float tensors in ``dtype``."""
    def move(t):
        if not isinstance(t, torch.Tensor):
            return t
        return t.to(device, dtype) if t.is_floating_point() else t.to(device)
    return Case(move(case.query), {k: move(v) for k, v in case.cascade.items()},
                tuple(move(t) for t in case.plain))
