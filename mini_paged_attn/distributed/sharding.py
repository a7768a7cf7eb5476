"""How a decoder is split over tensor-parallel ranks (Megatron style).

- Attention: each rank owns ``num_q_heads / N`` consecutive query heads and the KV heads they
  read. With ``N <= num_kv_heads`` the KV heads are split too (``num_kv_heads / N`` each);
  with more ranks than KV heads every rank holds the one KV head its query heads share, so a
  KV head is replicated on ``N / num_kv_heads`` ranks (as vLLM does).
- MLP: gate/up rows split in ``N`` (column parallel), down_proj columns likewise (row
  parallel, all-reduced).
- Vocabulary: ``ceil(vocab_size / N)`` rows of the embedding and the LM head per rank; the
  last rank's tail past ``vocab_size`` is padding (zero rows, logits cut off).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.args import cdiv, positive_int


def check_tensor_parallel_size(tensor_parallel_size: object, num_q_heads: int,
                               num_kv_heads: int, intermediate_size: int) -> int:
    """Return ``tensor_parallel_size`` as an int if the model splits into that many ranks.

    Raises:
        ValueError: not a positive int; it does not divide num_attention_heads, or the KV heads
            cannot be split or replicated evenly, or it does not divide intermediate_size (the
            message names both values).
    """
    n = positive_int("tensor_parallel_size", tensor_parallel_size)
    if num_q_heads % n:
        raise ValueError(f"tensor_parallel_size: expected a divisor of num_attention_heads="
                         f"{num_q_heads}, got {n}")
    if num_kv_heads % n and n % num_kv_heads:
        raise ValueError(f"tensor_parallel_size: expected a divisor or a multiple of "
                         f"num_key_value_heads={num_kv_heads}, got {n}")
    if intermediate_size % n:
        raise ValueError(f"tensor_parallel_size: expected a divisor of intermediate_size="
                         f"{intermediate_size}, got {n}")
    return n


@dataclass(frozen=True)
class ShardLayout:
    """What rank ``rank`` of ``world_size`` holds of a model (all counts are this rank's).

    Attributes:
        rank, world_size: the rank and the tensor-parallel size.
        num_q_heads, q_head_start: this rank's query heads are
            ``q_head_start .. q_head_start + num_q_heads`` of the model's.
        num_kv_heads, kv_head_start: likewise for the KV heads it stores (replicated ones
            included).
        intermediate_size, intermediate_start: its rows of gate_proj / up_proj (columns of
            down_proj).
        vocab_rows, vocab_start, vocab_valid: its rows of the embedding / LM head
            (``vocab_rows`` allocated, the first ``vocab_valid`` of them real tokens from
            ``vocab_start`` on, the rest padding).
        vocab_size: the model's vocabulary (to cut the gathered logits).
    """

    rank: int
    world_size: int
    num_q_heads: int
    q_head_start: int
    num_kv_heads: int
    kv_head_start: int
    intermediate_size: int
    intermediate_start: int
    vocab_rows: int
    vocab_start: int
    vocab_valid: int
    vocab_size: int

    @classmethod
    def of(cls, config, rank: int = 0, world_size: int = 1) -> ShardLayout:
        """The layout of ``config`` (a ModelConfig) on ``rank`` of ``world_size``."""
        n = check_tensor_parallel_size(world_size, config.num_q_heads, config.num_kv_heads,
                                       config.intermediate_size)
        if not 0 <= rank < n:
            raise ValueError(f"rank: expected 0 <= rank < {n}, got {rank}")
        q = config.num_q_heads // n
        kv_total = config.num_kv_heads
        if n <= kv_total:
            kv, kv_start = kv_total // n, rank * (kv_total // n)
        else:                                   # replicated: the KV head of this rank's q heads
            kv, kv_start = 1, rank // (n // kv_total)
        inter = config.intermediate_size // n
        rows = cdiv(config.vocab_size, n)
        vocab_start = min(rank * rows, config.vocab_size)
        valid = min(rows, config.vocab_size - vocab_start)
        return cls(rank, n, q, rank * q, kv, kv_start, inter, rank * inter, rows, vocab_start,
                   valid, config.vocab_size)

    @property
    def sharded(self) -> bool:
        return self.world_size > 1


__all__ = ["ShardLayout", "check_tensor_parallel_size"]
