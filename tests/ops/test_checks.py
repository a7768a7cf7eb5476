"""Bad arguments to the paged attention ops: ValueError naming the argument, nothing written."""

from __future__ import annotations

import pytest
import torch

from mini_paged_attn.ops import paged_decode, paged_prefill, store_kv
from mini_paged_attn.ops.attention.decode_plan import DecodeTiles
from mini_paged_attn.ops.prefill_plan import PrefillConfig

NUM_BLOCKS, BLOCK_SIZE, HKV, HQ, D = 6, 4, 2, 4, 8


def decode_args():
    gen = torch.Generator().manual_seed(0)
    return dict(
        query=torch.randn(2, HQ, D, generator=gen),
        key_cache=torch.randn(NUM_BLOCKS, BLOCK_SIZE, HKV, D, generator=gen),
        value_cache=torch.randn(NUM_BLOCKS, BLOCK_SIZE, HKV, D, generator=gen),
        block_tables=torch.tensor([[3, 1, 99], [0, -7, -7]], dtype=torch.int32),
        context_lens=torch.tensor([6, 3], dtype=torch.int32),
    )


def prefill_args():
    args = decode_args()
    args["query"] = torch.randn(5, HQ, D, generator=torch.Generator().manual_seed(1))
    args["cu_seqlens_q"] = torch.tensor([0, 3, 5], dtype=torch.int32)
    return args


def int32(*values):
    return torch.tensor(values, dtype=torch.int32)


# (argument named in the error, change to the valid arguments; a callable gets the number of
# query rows); each applies to decode and prefill unless marked.
BAD = [
    ("block_tables", dict(block_tables=int32(3, 1, 99, 0, -7, -7).view(2, 3).long())),
    ("context_lens", dict(context_lens=torch.tensor([6, 3]))),  # int64
    ("query", dict(query="q")),
    ("query", dict(query=lambda rows: torch.zeros(rows, HQ, D, dtype=torch.int32))),
    ("query", dict(query=lambda rows: torch.zeros(rows, 3, D))),  # 3 q heads over 2 kv heads
    ("query", dict(query=lambda rows: torch.zeros(rows, HQ, 2 * D)[..., ::2])),  # stride 2
    ("query", dict(query=lambda rows: torch.zeros(rows, HQ * D))),
    ("key_cache", dict(query=lambda rows: torch.zeros(rows, HQ, 16))),  # the cache's is 8
    ("key_cache", dict(key_cache=torch.zeros(NUM_BLOCKS, BLOCK_SIZE, HKV, D).half())),
    ("key_cache", dict(key_cache=torch.zeros(NUM_BLOCKS, BLOCK_SIZE, HKV * D))),
    ("value_cache", dict(value_cache=torch.zeros(NUM_BLOCKS, BLOCK_SIZE, HKV, D, device="meta"))),
    ("value_cache", dict(value_cache=torch.zeros(NUM_BLOCKS + 1, BLOCK_SIZE, HKV, D))),
    ("block_tables", dict(block_tables=int32(3, 1, 0, 2))),  # 1-D
    ("block_tables", dict(block_tables=int32(3, 1, 99).view(1, 3))),  # 1 row for 2 sequences
    ("block_tables", dict(block_tables=int32(3, 1, 99, 0, -7, -7).view(2, 3).to("meta"))),
    # 3 lengths for 2 sequences (prefill counts sequences by context_lens, so there the
    # mismatch is found in cu_seqlens_q's shape).
    (("context_lens", "cu_seqlens_q"), dict(context_lens=int32(6, 3, 1))),
    ("context_lens", dict(context_lens=int32(6, 3).to("meta"))),
    ("context_lens", dict(context_lens=int32(13, 3))),  # beyond the table's 3 blocks of 4
    ("context_lens", dict(context_lens=int32(6, -1))),
    ("block_tables", dict(context_lens=int32(9, 3))),  # uses entry [0, 2] = 99: not a block
    ("block_tables", dict(context_lens=int32(6, 5))),  # uses entry [1, 1] = -7
    ("block_tables", dict(block_tables=int32(3, 6, 0, 0, 0, 0).view(2, 3))),  # 6 = num_blocks
    ("scale", dict(scale=0.0)),
    ("scale", dict(scale="0.1")),
    ("backend", dict(backend="cuda")),
    ("num_splits", dict(num_splits=2)),  # decode only; the torch backend does not split
    ("cu_seqlens_q", dict(cu_seqlens_q=torch.tensor([0, 3, 5]))),  # prefill only: int64
    ("cu_seqlens_q", dict(cu_seqlens_q=int32(0, 5))),  # prefill only: 1 sequence for 2
    ("cu_seqlens_q", dict(cu_seqlens_q=int32(1, 3, 5))),  # does not start at 0
    ("cu_seqlens_q", dict(cu_seqlens_q=int32(0, 4, 3))),  # decreasing
    ("cu_seqlens_q", dict(cu_seqlens_q=int32(0, 2, 4))),  # ends before total_q = 5
    ("cu_seqlens_q", dict(cu_seqlens_q=int32(0, 1, 5))),  # q_len 4 > context_len 3
    ("scale", dict(scale=float("inf"))),
    ("return_lse", dict(return_lse=1)),
    ("causal", dict(causal=None)),  # prefill only
    ("max_seqlen_q", dict(max_seqlen_q=-1)),  # prefill only
    ("max_seqlen_q", dict(max_seqlen_q=2.5)),  # prefill only
    ("explain", dict(explain="yes")),  # decode only
    ("context_lens", dict(context_lens=int32(6, 0, 3, 0)[::2])),  # strided: read as 6, 0
    ("cu_seqlens_q", dict(cu_seqlens_q=int32(0, 9, 3, 9, 5)[::2])),  # prefill only: strided
    ("seq_order", dict(seq_order=int32(0, 0))),  # decode only: not a permutation
    ("seq_order", dict(seq_order=int32(1, 2))),  # decode only: 2 is no row
    ("seq_order", dict(seq_order=torch.tensor([1, 0]))),  # decode only: int64
    ("seq_order", dict(seq_order=int32(1, 0, 2))),  # decode only: 3 entries for 2 sequences
    ("seq_order", dict(seq_order=int32(1, 9, 0, 9)[::2])),  # decode only: strided
]


def applies(op, change):
    """decode has no cu_seqlens_q, causal or max_seqlen_q; prefill has no num_splits,
    explain or seq_order."""
    only_prefill = {"cu_seqlens_q", "causal", "max_seqlen_q"} & change.keys()
    only_decode = {"num_splits", "explain", "seq_order"} & change.keys()
    return not (only_prefill if op == "decode" else only_decode)


def out_like(query, rows):
    """A valid out tensor with a recognisable pattern, to check that it stays untouched."""
    ok = (isinstance(query, torch.Tensor) and query.dtype.is_floating_point and query.dim() == 3
          and query.stride(-1) == 1)
    shape = query.shape if ok else (rows, HQ, D)
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)


CASES = [(op, name if isinstance(name, str) else name[op == "prefill"], change)
         for op in ("decode", "prefill") for name, change in BAD if applies(op, change)]


@pytest.mark.parametrize("op, name, change", CASES,
                         ids=[f"{op}-{name}-{i}" for i, (op, name, _) in enumerate(CASES)])
def test_bad_argument_raises_naming_it_and_writes_nothing(op, name, change):
    args = decode_args() if op == "decode" else prefill_args()
    fn = paged_decode if op == "decode" else paged_prefill
    rows = args["query"].shape[0]
    args.update({k: v(rows) if callable(v) else v for k, v in change.items()})
    out = out_like(args["query"], rows)
    snapshot = out.clone()
    caches = (args["key_cache"].clone(), args["value_cache"].clone())
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        fn(**args, out=out)
    assert torch.equal(out, snapshot)
    if args["key_cache"].device.type != "meta" and args["value_cache"].device.type != "meta":
        assert torch.equal(args["key_cache"], caches[0]) and torch.equal(args["value_cache"],
                                                                          caches[1])


def test_valid_arguments_pass():
    """The unchanged arguments work, so each failure above is due to its one change."""
    out = torch.zeros(2, HQ, D)
    paged_decode(**decode_args(), out=out, backend="torch")
    assert out.abs().sum() > 0
    out = torch.zeros(5, HQ, D)
    paged_prefill(**prefill_args(), out=out, backend="torch")
    assert out.abs().sum() > 0


def test_out_with_wrong_shape_or_dtype_is_refused():
    for out, in ((torch.zeros(3, HQ, D),), (torch.zeros(2, HQ, D).half(),)):
        snapshot = out.clone()
        with pytest.raises(ValueError, match="^out:"):
            paged_decode(**decode_args(), out=out)
        assert torch.equal(out, snapshot)


def store_args():
    gen = torch.Generator().manual_seed(2)
    return dict(key=torch.randn(3, HKV, D, generator=gen),
                value=torch.randn(3, HKV, D, generator=gen),
                key_cache=torch.zeros(NUM_BLOCKS, BLOCK_SIZE, HKV, D),
                value_cache=torch.zeros(NUM_BLOCKS, BLOCK_SIZE, HKV, D),
                slot_mapping=torch.tensor([5, -1, 23]))


@pytest.mark.parametrize("name, change", [
    ("slot_mapping", dict(slot_mapping=torch.tensor([5, -2, 23]))),
    ("slot_mapping", dict(slot_mapping=torch.tensor([5, 1, NUM_BLOCKS * BLOCK_SIZE]))),
    ("slot_mapping", dict(slot_mapping=torch.tensor([5, 1]))),
    ("slot_mapping", dict(slot_mapping=torch.tensor([5.0, 1.0, 2.0]))),
    ("slot_mapping", dict(slot_mapping=torch.tensor([5, 0, 1, 0, 2, 0])[::2])),  # strided
    ("key", dict(key=torch.zeros(3, HKV + 1, D))),
    ("value", dict(value=torch.zeros(2, HKV, D))),
    ("value", dict(value=torch.zeros(3, HKV, D).half())),
    ("key_cache", dict(key_cache=torch.zeros(NUM_BLOCKS, BLOCK_SIZE, HKV, D).half())),
])
def test_store_kv_bad_argument_writes_nothing(name, change):
    args = {**store_args(), **change}
    with pytest.raises(ValueError, match=rf"^{name}:"):
        store_kv(**args)
    assert not args["key_cache"].any() and not args["value_cache"].any()


@pytest.mark.parametrize("cls, field, value", [
    (DecodeTiles, "block_n", 48), (DecodeTiles, "num_warps", True),
    (DecodeTiles, "num_stages", 13), (DecodeTiles, "num_stages", True),
    (PrefillConfig, "block_m", 8), (PrefillConfig, "num_warps", 3),
    (PrefillConfig, "num_stages", 9),
])
def test_bad_launch_config_raises_naming_the_field(cls, field, value):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        cls(**{field: value})
