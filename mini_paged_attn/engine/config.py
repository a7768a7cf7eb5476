"""EngineConfig: the engine's knobs (pool sizing, batch limits, caching, CUDA graphs), validated."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.args import check_bool, is_int, is_number, positive_int
from ..core.cascade import CascadeRule
from ..ops.dispatch import BACKENDS
from ..ops.kv_quant import KV_CACHE_DTYPES
from .spec.config import SpeculativeConfig

# KV cache budget on CPU, where there is no free-memory query worth trusting.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30

CPU_CONTEXT_BUDGET = 2048
"""The context budget ``max_num_batched_context_tokens="auto"`` sets on the CPU. There a
step's attention (the torch reference's gather and einsums) costs in proportion to the KV
tokens it reads, so a few long requests slow every step of the short ones; 2,048 kept the
hostile mix's ordinary clients within 1.7x of their quiet latency on a 2-core machine, where
no bound left them at 2.6x (docs/performance-notes.md, "Before and after, the whole mix")."""


@dataclass(frozen=True)
class EngineConfig:
    """How the engine sizes its KV pool and batches.

    Args:
        block_size: tokens per KV block (any positive size; powers of two such as 16 are fastest).
        num_kv_blocks: the pool's size in blocks; None sizes it automatically: on CUDA from the
            free GPU memory (``gpu_memory_utilization`` of the total, minus what the weights
            and a profiled step take), on CPU from ``cpu_kv_cache_bytes``.
        gpu_memory_utilization: share of the GPU's memory this engine may use, in (0, 1].
        cpu_kv_cache_bytes: the KV budget on CPU (default 1 GiB).
        max_num_seqs: sequences in one step at most (also the largest CUDA-graph batch).
        max_num_batched_tokens: tokens in one step at most (the scheduler's budget).
        max_num_batched_context_tokens: the KV tokens a step's running sequences may attend
            over, summed; past it the step takes the shortest contexts first and the long ones
            in turn (``core/context_budget.py``), so a few long requests do not slow every
            step of the short ones. None: no bound (every running sequence, every step).
            ``"auto"``: :data:`CPU_CONTEXT_BUDGET` on the CPU, no bound on CUDA (there a step's
            time is mostly its weights); what ``mini-paged-attn serve`` uses.
        max_model_len: prompt + generated tokens of one sequence at most; None: the model's
            max_position_embeddings.
        enable_prefix_caching: reuse the KV blocks of earlier prompts with the same prefix.
        enforce_eager: never use CUDA graphs.
        seed: seeds the sampling of requests without their own seed.
        backend: paged attention backend, "auto" | "torch" | "triton".
        kv_cache_dtype: "auto" (the model's dtype) or "fp8" (alias "fp8_e4m3"): the pool is
            ``torch.float8_e4m3fn`` and holds twice the tokens of a 16-bit pool in the same
            memory. K/V are stored unscaled (scale 1.0: e4m3 covers +-448, ample for keys and
            values of the models here).
        log_stats_interval_s: log a stats line at INFO at most this often while busy.
        tensor_parallel_size: processes (one GPU each on CUDA) the model is split over; 1
            runs in the caller's process alone. Must divide the model's attention heads
            (checked when the model is read, before any process starts).
        distributed_timeout_s: how long a tensor-parallel rank waits for the others (the
            rendezvous, one collective, a worker's start) before the engine gives up.
        step_timeout_s: under tensor parallelism, how long one step may take on rank 0
            before the engine fails as if a rank had died (a rank stopped or hung would
            otherwise hold every request for ``distributed_timeout_s``); None: no limit of
            its own. 60 s: far beyond a step of the models served here (a full 8192-token
            prefill), short of the group's timeout (``engine/worker/tp_watchdog.py``).
        async_scheduling: schedule and launch step t + 1 before step t's tokens reach the
            host (they stay on the device as t + 1's inputs), so the host's scheduling and
            output handling run while the GPU computes. ``step()`` then returns a step's
            outputs one call later. None: on with CUDA and one rank. Steps that need their
            tokens on the host at once (forking n > 1 samples, prompt logprobs) and tensor
            parallelism run synchronously; while a request with structured outputs is live,
            a step's sampling also waits for the next call (its grammar masks need the
            previous step's tokens, see ``engine/in_flight.py``).
        cascade_attention: let a step whose sequences share prefix blocks (a cached system
            prompt, ``n > 1`` samples) attend over each shared prefix once per group
            (``ops.cascade_attention``) where ``cascade_rule`` says it pays (the default). A
            decode step replays a captured cascade graph holding up to
            ``cascade_inputs.GRAPH_GROUPS`` groups; a prompt step with cascade runs eagerly.
            False: every step attends plainly (and no cascade graphs are captured).
        cascade_rule: when a group of sequences uses cascade attention
            (:class:`~mini_paged_attn.core.cascade.CascadeRule`: group size, prefix tokens,
            KV tokens saved).
        speculative_config: speculative decoding (a
            :class:`~mini_paged_attn.engine.spec.config.SpeculativeConfig`, or a dict of its
            fields, vLLM's names: ``{"method": "ngram", "num_speculative_tokens": k,
            "prompt_lookup_min": a, "prompt_lookup_max": b}`` or ``{"method": "draft_model",
            "model": PATH, "num_speculative_tokens": k}``); None: off. Outputs are those of
            the engine without it (greedy: token for token; sampled: the same distribution).
            While a step may speculate (at most ``disable_by_batch_size`` running sequences)
            steps run synchronously, as with ``async_scheduling=False``: proposals are made
            from the tokens of the step before. Under tensor parallelism it is refused.
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = DEFAULT_CPU_KV_CACHE_BYTES
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_num_batched_context_tokens: int | str | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    seed: int = 0
    backend: str = "auto"
    kv_cache_dtype: str = "auto"
    log_stats_interval_s: float = 10.0
    tensor_parallel_size: int = 1
    distributed_timeout_s: float = 120.0
    step_timeout_s: float | None = 60.0
    async_scheduling: bool | None = None
    cascade_attention: bool = True
    cascade_rule: CascadeRule = field(default_factory=CascadeRule)
    speculative_config: SpeculativeConfig | dict | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config",
                           SpeculativeConfig.of(self.speculative_config))
        # positive_int returns a Python int (numpy / torch integers come in as well).
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "cpu_kv_cache_bytes",
                     "tensor_parallel_size"):
            object.__setattr__(self, name, positive_int(name, getattr(self, name)))
        for name in ("num_kv_blocks", "max_model_len"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, positive_int(name, getattr(self, name)))
        budget = self.max_num_batched_context_tokens
        if budget is not None and not (isinstance(budget, str) and budget == "auto"):
            object.__setattr__(self, "max_num_batched_context_tokens",
                               positive_int("max_num_batched_context_tokens", budget))
        u = self.gpu_memory_utilization
        if not is_number(u) or not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization: expected a number in (0, 1], got {u!r}")
        if not is_int(self.seed):
            raise ValueError(f"seed: expected an int, got {self.seed!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {self.backend!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: expected one of {KV_CACHE_DTYPES}, got "
                             f"{self.kv_cache_dtype!r}")
        t = self.log_stats_interval_s
        if not is_number(t) or not 0 <= t < float("inf"):
            raise ValueError(f"log_stats_interval_s: expected a number >= 0, got {t!r}")
        t = self.distributed_timeout_s
        if not is_number(t) or not 0 < t < float("inf"):
            raise ValueError(f"distributed_timeout_s: expected a number > 0, got {t!r}")
        t = self.step_timeout_s
        if t is not None and (not is_number(t) or not 0 < t < float("inf")):
            raise ValueError(f"step_timeout_s: expected None or a number > 0, got {t!r}")
        for name in ("enable_prefix_caching", "enforce_eager", "cascade_attention"):
            check_bool(name, getattr(self, name))
        if self.async_scheduling is not None:
            check_bool("async_scheduling", self.async_scheduling)
        if not isinstance(self.cascade_rule, CascadeRule):
            raise ValueError("cascade_rule: expected a CascadeRule, got "
                             f"{type(self.cascade_rule).__name__}")
        if self.speculative_config is not None and self.tensor_parallel_size > 1:
            raise ValueError(f"speculative_config: expected None with tensor_parallel_size > 1 "
                             f"(the ranks' steps carry no proposals), got "
                             f"{self.speculative_config}")


def resolve_context_budget(config: EngineConfig, device_type: str) -> int | None:
    """The scheduler's ``max_num_batched_context_tokens`` for an engine on ``device_type``
    ("cpu", "cuda", ...): the config's, with ``"auto"`` resolved (see :class:`EngineConfig`)."""
    budget = config.max_num_batched_context_tokens
    if budget == "auto":
        return CPU_CONTEXT_BUDGET if device_type == "cpu" else None
    return budget


def resolve_max_model_len(config: EngineConfig, max_position_embeddings: int) -> int:
    """The engine's maximum sequence length: ``config.max_model_len`` or the model's.

    Raises:
        ValueError: max_model_len over the model's max_position_embeddings.
    """
    max_len = config.max_model_len or max_position_embeddings
    if max_len > max_position_embeddings:
        raise ValueError(f"max_model_len: expected <= the model's max_position_embeddings "
                         f"({max_position_embeddings}), got {max_len}")
    return max_len


__all__ = ["CPU_CONTEXT_BUDGET", "DEFAULT_CPU_KV_CACHE_BYTES", "EngineConfig",
           "resolve_context_budget", "resolve_max_model_len"]
