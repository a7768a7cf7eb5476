"""How many KV blocks the model runner's pool gets when ``num_kv_blocks`` is not given.

On CPU: ``cpu_kv_cache_bytes`` worth, capped by what the running sequences can ever hold. On
CUDA: ``gpu_memory_utilization`` of the device, less what is in use, the peak of a profiled
full step (a forward over ``max_num_batched_tokens`` tokens, logits and sampling for
``max_num_seqs`` rows), the CUDA graphs' reserve and what the attention backend's calls may
allocate beyond a profiled step (``AttentionBackend.workspace_bytes``). Under tensor
parallelism every rank takes the smallest pool of all ranks, so every block id the scheduler
hands out exists everywhere.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from ...core.sliding_window import max_blocks_in_use
from ...models.config import ModelConfig
from ..sampling_params import SamplingParams
from .input_batch import batch_buckets, padded_rows

if TYPE_CHECKING:
    from .model_runner import ModelRunner

logger = logging.getLogger(__name__)

GRAPH_MEMORY_RESERVE = 512 << 20
"""Left free for the CUDA graphs' memory pool and allocator fragmentation."""


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype,
                   num_kv_heads: int | None = None) -> int:
    """Bytes of one block over all layers (K and V); ``num_kv_heads``: the KV heads one rank
    stores (default: all of the model's)."""
    elem = torch.empty((), dtype=dtype).element_size()
    heads = config.num_kv_heads if num_kv_heads is None else num_kv_heads
    return config.num_layers * 2 * block_size * heads * config.head_size * elem


def auto_num_blocks(runner: ModelRunner, max_model_len: int) -> int:
    """The pool's block count for ``runner`` (its model, config, device and shard layout set;
    the pool not made yet).

    Raises:
        ValueError: naming ``num_kv_blocks`` when not even one block fits.
    """
    config, model_config = runner.config, runner.model_config
    per_block = kv_block_bytes(model_config, runner.block_size, runner.kv_dtype,
                               runner.layout.num_kv_heads) + runner.extra_block_bytes
    if runner.device.type != "cuda":
        budget = config.cpu_kv_cache_bytes
        # More than the running sequences can ever hold is never used (under a window, each
        # holds about one window of blocks, not its full length).
        cap = max_blocks_in_use(config.max_num_seqs, max_model_len,
                                config.max_num_batched_tokens, runner.block_size,
                                model_config.uniform_sliding_window)
        num_blocks = min(budget // per_block, cap)
        where = f"the CPU budget of {budget / 2**30:.2f} GiB"
    else:
        peak = profile_step_memory(runner, max_model_len)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(runner.device)
        reserve = (runner.attention.workspace_bytes(runner.attention_limits)
                   + (0 if config.enforce_eager else GRAPH_MEMORY_RESERVE))
        budget = int(total * config.gpu_memory_utilization) - (total - free) - peak - reserve
        num_blocks = max(0, budget) // per_block
        where = (f"{config.gpu_memory_utilization:.0%} of {total / 2**30:.1f} GiB, less "
                 f"{(total - free) / 2**30:.2f} GiB in use and a {peak / 2**30:.2f} GiB step peak")
    if num_blocks < 1:
        raise ValueError(f"num_kv_blocks: no room for a single KV block of {per_block} bytes "
                         f"in {where}; raise gpu_memory_utilization or pass num_kv_blocks")
    if runner.tp.world_size > 1:
        # Every rank must have every block id the scheduler hands out: the smallest pool.
        agreed = torch.tensor([num_blocks], dtype=torch.int64, device=runner.device)
        num_blocks = int(runner.tp.all_reduce(agreed, "min").item())
        where += f", the least of {runner.tp.world_size} ranks"
    logger.info("KV pool sized to %d blocks from %s", num_blocks, where)
    return num_blocks


@torch.inference_mode()
def profile_step_memory(runner: ModelRunner, max_model_len: int) -> int:
    """Peak bytes a full step takes beyond what is allocated now: a forward over
    max_num_batched_tokens tokens, logits and sampling for max_num_seqs rows (the logits over
    those rows rounded up to a batch bucket, as a CUDA step's LM head runs them)."""
    config, model_config, device = runner.config, runner.model_config, runner.device
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    num_tokens = config.max_num_batched_tokens
    lens = [min(max_model_len, num_tokens - i) for i in range(0, num_tokens, max_model_len)]
    # The pool does not exist yet: one scratch block, the only one the dummy batch reads.
    scratch = torch.zeros((2, 1, runner.block_size, runner.layout.num_kv_heads,
                           model_config.head_size), dtype=runner.kv_dtype, device=device)
    hidden = runner.run_dummy(lens, [(scratch[0], scratch[1])] * model_config.num_layers,
                              decode_only=False)
    rows = min(config.max_num_seqs, num_tokens)
    # As InputBuilder.logit_rows pads a CUDA step's sample rows, which may then exceed the
    # step's tokens when max_num_batched_tokens < max_num_seqs.
    logit_rows = padded_rows(batch_buckets(config.max_num_seqs), rows)
    index = torch.arange(logit_rows, device=device) % hidden.shape[0]
    logits = runner.model.compute_logits(hidden[index])
    params = [SamplingParams(temperature=0.7, top_p=0.9, top_k=50)] * rows
    runner.sampler(logits[:rows], params, [None] * rows)
    del hidden, logits
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


__all__ = ["GRAPH_MEMORY_RESERVE", "auto_num_blocks", "kv_block_bytes", "profile_step_memory"]
