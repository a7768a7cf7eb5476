"""ModelRunner: owns the KV cache (a PagedAttentionManager, sized by ``pool_sizing``, built by
:meth:`ModelRunner.build_cache` over the scheduler's block bookkeeping) and runs one forward per
step.

Per step, three calls the engine makes in order (see ``engine_step``): :meth:`ModelRunner.prepare`
builds the inputs on the host (once, vectorised, see ``input_batch``) and enqueues nothing;
:meth:`ModelRunner.forward` fills in the previous step's sampled ids on the device (asynchronous
scheduling: the engine passes that step's ``PendingSample``), makes the copy-on-write block
copies (all layers at once), runs the forward (on CUDA a captured graph for decode-only batches
and for a step of one prompt, see ``cuda_graphs`` and ``prefill_graphs``; else eager: always
for a prompt step whose sequences share prefix blocks worth attending over once,
``cascade_inputs``) and the logits for the rows that sample; :meth:`ModelRunner.sample`
enqueues the sampler. Between ``prepare`` and ``forward`` the engine may enqueue a held step's sampling, so the host builds
the inputs while that step's grammar masks fill. The only host sync is reading the sampled token
ids, which the engine may put off until the next step is launched. Requests that ask for prompt
logprobs also get the log-softmax of the logits of every prompt position the step computes (see
``prompt_logprobs``).

Under tensor parallelism every rank has a ModelRunner over its shard of the model and a pool of
its own KV heads with the same number of blocks (the other ranks' pools keep no block
bookkeeping: rank 0's scheduler allocates every block). Rank 0's runner builds each step's inputs and
hands them to ``peers`` (the other ranks, see ``tp_executor``) before its own forward; the
other ranks run :meth:`ModelRunner.execute_message`. Only rank 0 samples.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...cache.manager import PagedAttentionManager
from ...core.args import cdiv
from ...core.cascade import CascadePlan, CascadeRule
from ...core.kv_cache_manager import KVCacheManager
from ...core.scheduler import SchedulerOutput
from ...models.attention import Attention, AttentionMetadata
from ...models.config import ModelConfig
from ...models.load_progress import LoadTimer, timer_or_new
from ...ops.attention import AttentionLimits, AttentionSpec, choose_backend
from ...ops.kv_quant import kv_cache_torch_dtype
from ...ops.projection import SplitKWorkspace
from ..config import EngineConfig
from ..sample.prompt_logprobs import (PendingPromptLogprobs, PromptLogprobs, PromptRows,
                                      compute_prompt_logprobs, prompt_logprob_rows)
from ..sample.sampler import PendingSample, SampleRow, Sampler
from ..sampling_params import SamplingParams
from ..spec.verify import PendingVerify, VerifyRows, verify
from ..structured.bitmask import TokenMasks
from .cascade_inputs import dummy_cascade
from .cuda_graphs import DecodeGraphs
from .input_batch import (InputBuilder, StepInputs, batch_buckets, dummy_inputs,
                          table_width)
from .pool_sizing import auto_num_blocks
from .prefill_graphs import PrefillGraphs, PromptGraph
from .tp_messages import StepMessage

logger = logging.getLogger(__name__)

# What release_memory() drops: everything of the runner that holds device memory.
_DEVICE_STATE = ("model", "cache", "kv_caches", "inputs", "sampler", "workspace",
                 "linear_workspace")


class Released:
    """In the place of an object that shutdown released (a runner's KV cache, model, ...):
    any attribute read raises a RuntimeError naming it, not an AttributeError of None."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str):
        raise RuntimeError(f"{self._name}.{attr}: the engine was shut down and its device "
                           "memory released; build a new engine")

    def __repr__(self) -> str:
        return f"<{self._name}: released>"


@dataclass
class PreparedStep:
    """A step whose inputs :meth:`ModelRunner.prepare` built, for :meth:`ModelRunner.forward`.

    ``inputs``: the builder's step inputs (device views of the staging buffers);
    ``bucket`` / ``prompt_bucket``: the decode / prompt graph it replays, if any;
    ``logits_dtype``: the dtype its logits are computed in; ``params`` / ``seeds``: per
    sample row, its request's params and seed key (None: unseeded), as the sampler takes them;
    ``cascade``: the shared-prefix groups it attends over once (``core.cascade``; a cascade
    step runs eagerly), or None; ``verify``: the sequences that verify proposals and where
    their rows start in the logits (after the sample rows), or None.
    """

    out: SchedulerOutput
    inputs: StepInputs
    bucket: int | None
    prompt_bucket: PromptGraph | None
    logits_dtype: torch.dtype
    params: list[SamplingParams]
    seeds: list[tuple[str, int] | None]
    cascade: CascadePlan | None = None
    verify: VerifyRows | None = None


class ModelRunner:
    """Owns the KV cache tensors and runs the model for scheduled steps.

    Args:
        model: a ``CausalLM`` on ``device`` (see models/).
        model_config: its config.
        config: engine config (block size, limits, pool sizing, CUDA graphs).
        max_model_len: the resolved maximum sequence length.
        peers: rank 0 under tensor parallelism: the other ranks, which get every step's
            inputs (``send(StepMessage)``) before this rank's forward; None otherwise.
        extra_block_bytes: device bytes another pool takes for each block of this one (a
            draft model's, ``spec/draft.py``), counted when the pool is sized from free memory.
    """

    def __init__(self, model, model_config: ModelConfig, config: EngineConfig,
                 max_model_len: int, *, peers=None, load_timer: LoadTimer | None = None,
                 extra_block_bytes: int = 0) -> None:
        self.model = model
        self.model_config = model_config
        self.config = config
        self.peers = peers
        self.released = False      # release_memory() ran
        # This rank's share of the heads (all of them with one rank).
        self.tp, self.layout = model.tp, model.layout
        self.device = device = model.device
        self.dtype = model.dtype
        # The pool's dtype: the model's, or fp8 (half the bytes per token).
        self.kv_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, model.dtype)
        self.block_size = bs = config.block_size
        # The attention backend, chosen once; ``backend`` is what the ops take for it.
        spec = AttentionSpec(device, model.dtype, self.kv_dtype, model_config.head_size, bs,
                             window=model_config.sliding_window is not None,
                             softcap=model_config.attn_logit_softcap > 0,
                             sinks=any(getattr(m, "sinks", None) is not None
                                       for m in model.modules()))
        self.attention = choose_backend(spec, config.backend)
        self.backend = self.attention.op_backend
        self.max_blocks_per_seq = cdiv(max_model_len, bs)
        self.table_width = table_width(self.max_blocks_per_seq)
        self.max_num_seqs = config.max_num_seqs
        self.sampler = Sampler(device, config.seed)
        self.prompt_logprobs: list[PromptLogprobs] = []    # of the latest step
        # The latest step's prompt logprobs on the device, read after its sampled tokens.
        self._prompt_device: PendingPromptLogprobs | None = None
        # What the attention backend sizes its workspaces and warm-up batches by.
        self.attention_limits = AttentionLimits(
            spec, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=max_model_len,
            table_width=self.table_width, num_q_heads=self.layout.num_q_heads,
            num_kv_heads=self.layout.num_kv_heads)
        self.workspace = self.attention.decode_workspace(self.attention_limits)
        # The projections' split-K scratch (ops.linear), shared by eager steps and graphs.
        self.linear_workspace = SplitKWorkspace(device) if device.type == "cuda" else None

        self._max_model_len = max_model_len
        self.extra_block_bytes = extra_block_bytes
        self._timer = timer = timer_or_new(load_timer)
        with timer.phase("kv pool"):
            self.num_blocks = config.num_kv_blocks or auto_num_blocks(self, max_model_len)
        # Built by build_cache, over the block bookkeeping the engine makes of num_blocks.
        self.cache: PagedAttentionManager | None = None
        self.graphs = self.prefill_graphs = None

    def build_cache(self, kv_manager: KVCacheManager | None) -> None:
        """Build the KV cache of :attr:`num_blocks` blocks and everything that reads it: the
        pool (its blocks are those of ``kv_manager``, the scheduler's; None on a
        tensor-parallel rank other than 0, which keeps no bookkeeping and copies the blocks
        rank 0 names), the block tables, the input buffers, the CUDA graphs and the kernels'
        warm-up. Call it once, after the constructor sized the pool."""
        assert self.cache is None, "build_cache runs once"
        config, model_config, model = self.config, self.model_config, self.model
        device, bs, max_model_len, timer = (self.device, self.block_size, self._max_model_len,
                                            self._timer)
        # The one KV cache: pool, block tables, copy-on-write.
        self.cache = PagedAttentionManager(
            config.max_num_seqs, self.layout.num_q_heads, model_config.head_size, bs,
            self.num_blocks, device=device, dtype=self.kv_dtype,
            num_kv_heads=self.layout.num_kv_heads, max_blocks_per_seq=self.table_width,
            num_layers=model_config.num_layers, kv_manager=kv_manager,
            block_bookkeeping=kv_manager is not None)
        self._timer = None
        self.kv_caches = self.cache.layer_caches
        # A decode graph pads the batch to its bucket: room for max_num_seqs tokens at least.
        max_num_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
        self.inputs = InputBuilder(
            self.cache.tables, max_num_seqs=config.max_num_seqs, max_num_tokens=max_num_tokens,
            block_size=bs, device=device, order_decode=self.backend == "triton",
            logit_buckets=batch_buckets(config.max_num_seqs) if device.type == "cuda" else None,
            cascade_rule=self.cascade_rule(), speculative=config.speculative_config is not None)

        self.graphs = self.prefill_graphs = None
        if device.type == "cuda" and not config.enforce_eager:
            self.graphs = DecodeGraphs(model, self.kv_caches, self.inputs,
                                       max_batch=config.max_num_seqs, backend=self.backend,
                                       decode_workspace=self.workspace,
                                       linear_workspace=self.linear_workspace)
            with timer.phase("graphs"):
                self.graphs.capture()
            if self.peers is not None:       # also at garbage collection, before NCCL closes
                self.peers.track_graphs(self.graphs)
            # Whole prompts attend over their new K/V only with a cache in the model's dtype
            # (else they take the paged graphs); other ranks would have to replay in step
            # with rank 0.
            if self.backend == "triton" and self.tp.world_size == 1:
                self.prefill_graphs = PrefillGraphs(
                    model, self.kv_caches, self.inputs,
                    max_tokens=min(config.max_num_batched_tokens, max_model_len),
                    backend=self.backend, contiguous=self.kv_dtype == model.dtype,
                    linear_workspace=self.linear_workspace)
                with timer.phase("graphs"):
                    self.prefill_graphs.capture(self.graphs.pool)
        if device.type == "cuda":
            # After the capture, so that the caching allocator holds the blocks eager steps
            # take beside the graphs' memory: run before it, the first long prompt would ask
            # CUDA for new segments; run after it, for none.
            with timer.phase("warm-up"):
                self._warm_up(max_model_len)
            # The pool sizing's and the warm-up's sampling drew from the engine's generator:
            # requests start from the seed, whatever the limits those steps were sized by.
            self.sampler.generator.manual_seed(config.seed)

    def cascade_rule(self) -> CascadeRule | None:
        """The rule of the engine's cascade steps, or None when it has none: cascade attention
        off, or every layer windowed (the op has no window; such a model's tables also begin
        with the pad entries of released blocks, which are not shared blocks)."""
        if not self.config.cascade_attention:
            return None
        if all(m.window_size != (-1, -1) for m in self.model.modules()
               if isinstance(m, Attention)):
            return None
        return self.config.cascade_rule

    @torch.inference_mode()
    def _warm_up(self, max_model_len: int) -> None:
        """Compile and load the kernels before the first request, so no request waits for it.

        - The attention backend names the batches that compile and load its kernel variants
          (``warmup_shapes``: for the Triton ones, lengths either side of their tile, Hopper
          and page-copy thresholds, whole prompts and steps over cached prefixes).
        - cuBLAS picks its GEMM kernel by the number of rows, and CUDA loads each kernel on
          its first launch, and a first launch waits for the device to drain, so a request's
          first step would pay both (docs/performance-notes.md, "Figures behind the code's
          rules"). One prompt of
          each power-of-two length up to max_num_batched_tokens loads the kernels that steps
          of those sizes use; the LM head (float32 and model-dtype logits) runs at each of
          the builder's ``logit_buckets``, the only row counts it sees, with greedy and
          one-pass temperature sampling.
        """
        start = time.perf_counter()
        cfg = self.config
        cascade = self.inputs.cascade_rule is not None
        for batch in self.attention.warmup_shapes(self.attention_limits):
            q_lens = [batch.q_len] * batch.num_seqs
            self.run_dummy(q_lens, self.kv_caches, decode_only=batch.q_len == 1,
                           no_prefix=batch.no_prefix)
            if cascade and (batch.q_len == 1 or not batch.no_prefix):
                # The cascade op's kernels (a non-causal prefill with lse, which picks its
                # tiles by the rows a group has, the suffix, the merge) at the same sizes:
                # compiled here, not in the first steps over a shared prefix (seconds each).
                self.run_dummy(q_lens, self.kv_caches, decode_only=batch.q_len == 1,
                               no_prefix=False, cascade=True)
        q_len = 16
        while q_len <= min(cfg.max_num_batched_tokens, max_model_len):
            self.run_dummy([q_len], self.kv_caches, decode_only=False)
            q_len *= 2
        buckets = self.inputs.logit_buckets or []
        hidden = torch.zeros(max(buckets, default=0), self.model_config.hidden_size,
                             dtype=self.model.dtype, device=self.device)
        for rows in buckets:
            for dtype in dict.fromkeys((torch.float32, self.model.dtype)):
                logits = self.model.compute_logits(hidden[:rows], dtype=dtype)
                self.sampler(logits, [SamplingParams(temperature=0.0)] * rows, [None] * rows)
            # The model-dtype logits (the last ones; greedy sampling left them as they were).
            self.sampler(logits, [SamplingParams(temperature=1.0)] * rows, [None] * rows)
        torch.cuda.synchronize(self.device)
        logger.info("warmed up the kernels in %.1f s", time.perf_counter() - start)

    def run_dummy(self, q_lens: list[int], kv_caches, *, decode_only: bool,
                   no_prefix: bool = True, cascade: bool = False) -> torch.Tensor:
        """Forward a made-up batch (see ``input_batch.dummy_inputs``: sequence ``i`` computes
        ``q_lens[i]`` tokens, writes nothing, reads block 0 of ``kv_caches``) through the
        decode path (every ``q_lens[i]`` 1) or the prefill path; ``cascade``: as one group
        over a prefix of block 0 (``cascade_inputs.dummy_cascade``). Returns the hidden
        states ``[sum(q_lens), hidden_size]``."""
        step = dummy_inputs(q_lens, self.table_width, self.device, no_prefix=no_prefix,
                            ordered=decode_only and self.backend == "triton")
        if cascade:
            step.cascade = dummy_cascade(step.block_tables, step.context_lens,
                                         sum(q_lens), self.block_size)
        meta = AttentionMetadata.for_step(step, decode_only=decode_only, backend=self.backend,
                                          decode_workspace=self.workspace,
                                          linear_workspace=self.linear_workspace)
        return self.model(step.input_ids, step.positions, kv_caches, meta)

    # ---- one step -----------------------------------------------------------------------------
    def release(self, seq_id: int) -> None:
        """The sequence left the running set: its block-table row is free again."""
        self.cache.tables.release(seq_id)

    def prepare(self, out: SchedulerOutput, pending: dict[int, int] | None = None
                ) -> PreparedStep:
        """Host work of a step before its launch: free the table rows of the sequences that
        left, build the inputs into the staging buffers (see ``input_batch``) and collect the
        sample rows' params. Nothing is enqueued on the device.

        ``pending`` (asynchronous scheduling): ``seq_id -> row`` of the previous step's
        sampled ids for the sequences whose input token the host does not know yet; their
        inputs are filled on the device by :meth:`forward`.
        """
        self.prompt_logprobs = []
        self._prompt_device = None
        for seq_id in out.released_seq_ids:
            self.release(seq_id)
        bucket = prompt_bucket = cascade_pad = None
        if self.graphs is not None and out.decode_only:
            bucket = self.graphs.bucket_for(out.num_seqs)
            # A bucket's cascade graphs hold a few groups: those that save the most.
            cascade_pad = self.graphs.cascade_pad(bucket)
            cascade = (self.inputs.plan_cascade(out, max_groups=cascade_pad.num_groups - 1)
                       if cascade_pad is not None else None)
            if cascade is None:
                cascade_pad = None
        else:
            # The prompt graphs hold the plain path: a prompt step with cascade is eager.
            cascade = self.inputs.plan_cascade(out)
            if cascade is None and self.prefill_graphs is not None:
                prompt_bucket = self.prefill_graphs.bucket_for(out)
        if cascade is not None:
            logger.debug("step of %d sequences: %s", out.num_seqs, cascade)
        step = self.inputs.build(
            out, pad_to=bucket, pending=pending,
            pad_prompt_to=prompt_bucket.tokens if prompt_bucket is not None else None,
            paged_prompt=prompt_bucket is not None and prompt_bucket.paged, cascade=cascade,
            cascade_pad=cascade_pad)
        params, seeds = _sample_params(out)
        rows = _verify_rows(out, len(params))
        # The LM head's own output where the sampler reads it as is (the ranks gather the
        # model-dtype columns either way; the other ranks drop their copy); verification
        # takes it where every verifying row is greedy.
        logits_dtype = (self.model.dtype if self.sampler.reads_model_dtype(params, seeds)
                        and (rows is None or all(p.greedy for p in rows.params))
                        else torch.float32)
        return PreparedStep(out, step, bucket, prompt_bucket, logits_dtype, params, seeds,
                            cascade, rows)

    @torch.inference_mode()
    def forward(self, out: SchedulerOutput, prepared: PreparedStep | None = None,
                sampled: PendingSample | None = None) -> torch.Tensor | None:
        """Enqueue a step's forward: logits ``[sum(out.num_samples), vocab_size]`` of its
        sample rows, or None when none samples (no host sync either way). They are float32,
        or in the model dtype where the sampler reads them so
        (``Sampler.reads_model_dtype``).

        ``prepared``: :meth:`prepare`'s result for ``out`` (None: prepared now, for a step
        with no pending inputs). ``sampled`` (asynchronous scheduling): the previous step's
        enqueued sampling, whose ids (int64 ``[num_rows]`` on the device) fill the inputs
        ``prepare`` left pending, on the device.
        """
        if prepared is None:
            prepared = self.prepare(out)
        assert prepared.out is out, "prepare(out) first"
        step, bucket, n = prepared.inputs, prepared.bucket, out.num_seqs
        if step.fill is not None:
            assert sampled is not None and self.peers is None, "a fill needs the sampled ids"
            step.fill.apply(step.input_ids, sampled.token_ids)
        if self.peers is not None:
            self.peers.send(StepMessage(
                self.inputs.host_arrays(step), num_seqs=n, table_width=step.block_tables.shape[1],
                max_seqlen_q=step.max_seqlen_q, num_sample_rows=step.num_sample_rows,
                decode_only=out.decode_only, graph_bucket=bucket,
                block_copies=list(out.block_copies), no_prefix=step.no_prefix))
        try:
            return self._forward(step, n, out.decode_only, bucket, out.block_copies,
                                 prompt_logprob_rows(out), prepared.logits_dtype,
                                 prepared.prompt_bucket)
        except Exception as exc:
            if self.peers is not None:
                self.peers.step_done()
                self.peers.check_after_failure(exc)   # raises naming a dead rank, if one is
            raise
        finally:
            if self.peers is not None:
                self.peers.step_done()              # the step's time budget ends

    def sample(self, prepared: PreparedStep, logits: torch.Tensor,
               overlap: Callable[[], None] | None = None,
               masks: Callable[[], TokenMasks | None] | None = None,
               rows: list[SampleRow] | None = None) -> PendingSample:
        """Enqueue the sampling of :meth:`forward`'s ``logits`` for the step ``prepared``, one
        row per sample (a request about to fork has ``n`` rows); the ids stay on the device
        until :meth:`PendingSample.read`. ``overlap`` is called once the step's device work
        is enqueued; ``masks`` makes the grammar bitmask of the sample rows with structured
        outputs (called by the sampler only if some row has them); ``rows``: the step's
        :meth:`history_rows` taken when it was launched (default: made now). A synchronous
        step then reads the ids and :meth:`read_prompt_logprobs`."""
        out = prepared.out
        if prepared.verify is not None:     # its rows follow the sample rows
            logits = logits[:prepared.verify.first_row]
        # Made only if some row uses penalties or min_tokens.
        return self.sampler.sample(logits, prepared.params, prepared.seeds, overlap,
                                   (lambda: rows) if rows is not None else
                                   (lambda: _sample_rows(out)), masks)

    def verify(self, prepared: PreparedStep, logits: torch.Tensor) -> PendingVerify:
        """Enqueue the verification of the proposals of ``prepared``'s step (its
        ``verify`` rows of :meth:`forward`'s ``logits``), drawing from the engine's
        generator; :meth:`PendingVerify.read` gives what each sequence keeps
        (``spec/verify.py``)."""
        rows = prepared.verify
        assert rows is not None, "the step verifies no proposals"
        return verify(logits[rows.first_row:rows.first_row + rows.num_rows], rows,
                      self.sampler.generator)

    @staticmethod
    def history_rows(out: SchedulerOutput) -> list[SampleRow] | None:
        """What penalties and min_tokens will read of ``out``'s samples, as they are now (a
        step sampled after the scheduler moved past it gives them to :meth:`sample`); None
        when no row uses them."""
        if not any(seq.request.params.uses_history for seq in out.seqs):
            return None
        return _sample_rows(out)

    @torch.inference_mode()
    def execute_message(self, message: StepMessage) -> None:
        """A non-zero tensor-parallel rank's part of a step rank 0 scheduled: the same
        forward over this rank's shard and KV heads (its collectives pair with rank 0's);
        the logits, gathered on every rank, are dropped here (rank 0 samples)."""
        step = self.inputs.load(message.arrays, table_width=message.table_width,
                                max_seqlen_q=message.max_seqlen_q,
                                num_sample_rows=message.num_sample_rows,
                                no_prefix=message.no_prefix)
        self._forward(step, message.num_seqs, message.decode_only, message.graph_bucket,
                      message.block_copies, logits_dtype=self.model.dtype)

    def _forward(self, step, num_seqs: int, decode_only: bool, bucket: int | None,
                 block_copies, prompt_rows: PromptRows | None = None,
                 logits_dtype: torch.dtype = torch.float32,
                 prompt_bucket: PromptGraph | None = None) -> torch.Tensor | None:
        """Copy-on-write, the forward (a decode graph's replay when ``bucket`` is set, a
        prefill graph's when ``prompt_bucket`` is, see :meth:`forward`) and the LM head
        on the sample rows: logits ``[num_sample_rows, vocab_size]`` in ``logits_dtype``, or
        None when no row samples. Every rank runs it, in the same order of collectives.
        ``prompt_rows`` (rank 0, one rank only): the prompt positions whose logprobs go to
        :attr:`prompt_logprobs`."""
        if block_copies:
            self.cache.copy_blocks(block_copies)
        if bucket is not None:
            hidden = self.graphs.replay(num_seqs, step.block_tables, step.cascade)
        elif prompt_bucket is not None:
            hidden = self.prefill_graphs.replay(prompt_bucket, step.input_ids.shape[0])
        else:
            meta = AttentionMetadata.for_step(step, decode_only=decode_only,
                                              backend=self.backend, decode_workspace=self.workspace,
                                              linear_workspace=self.linear_workspace)
            hidden = self.model(step.input_ids, step.positions, self.kv_caches, meta)
        if prompt_rows is not None:
            self._prompt_device = compute_prompt_logprobs(self.model, hidden, prompt_rows)
        if step.num_sample_rows == 0:
            return None
        if step.sample_rows is None:
            hidden = hidden[:step.logit_rows]
        else:
            hidden = hidden.index_select(0, step.sample_rows)
        # The padding rows' logits are computed and dropped (the first rows: still contiguous).
        return self.model.compute_logits(hidden, dtype=logits_dtype)[:step.num_sample_rows]

    def release_graphs(self) -> None:
        """Destroy the decode graphs once the device is idle (later decode steps run
        eagerly). A tensor-parallel worker calls it before its group closes: NCCL's teardown
        waits while graphs that captured its collectives exist (rank 0's are destroyed by
        ``TPWorkers``, see ``track_graphs``)."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None

    def release_memory(self) -> None:
        """Give back this runner's device memory: wait for the device, destroy the CUDA graphs
        (decode and prompt), then drop the KV pool, the workspaces, the input buffers, the
        sampler's state and the model's weights; each stands as a :class:`Released` after,
        which raises on use. On CUDA, the caching allocator's unused blocks go back to the
        device too. Idempotent.

        The memory returns once nothing else holds those objects: ``LLMEngine.shutdown``
        drops the engine's own references first.
        """
        if self.released:
            return
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        self.release_graphs()
        if self.prefill_graphs is not None:
            self.prefill_graphs.release()
            self.prefill_graphs = None
        self.prompt_logprobs = []
        self._prompt_device = None
        for name in _DEVICE_STATE:
            setattr(self, name, Released(f"ModelRunner.{name}"))
        self.released = True
        if cuda:
            torch.cuda.empty_cache()

    def read_prompt_logprobs(self) -> None:
        """The latest step's prompt logprobs, to the host, into :attr:`prompt_logprobs`
        (nothing when it computed none)."""
        if self._prompt_device is not None:
            self.prompt_logprobs = self._prompt_device.read()
            self._prompt_device = None


def _sample_params(out: SchedulerOutput
                   ) -> tuple[list[SamplingParams], list[tuple[str, int] | None]]:
    """Per sample row, its request's params and its seed key (None: unseeded), as
    :meth:`Sampler.sample` takes them."""
    params, seeds = [], []
    for seq, k in zip(out.seqs, out.num_samples):
        p = seq.request.params
        for j in range(k):
            params.append(p)
            seeds.append(None if p.seed is None else
                         (seq.request.request_id, seq.index if k == 1 else j))
    return params, seeds


def _verify_rows(out: SchedulerOutput, first_row: int) -> VerifyRows | None:
    """The sequences of ``out`` that verify proposals, in batch order (their rows follow the
    ``first_row`` sample rows of the others), or None."""
    spec = out.spec_token_ids
    if not spec:
        return None
    order = sorted(spec)
    return VerifyRows(order, [spec[i] for i in order],
                      [out.seqs[i].request.params for i in order], first_row)


def _sample_rows(out: SchedulerOutput) -> list[SampleRow]:
    """Per sample row, what penalties and min_tokens read of its sample (a request about to
    fork has one row per sample index, all from sequence 0)."""
    rows = []
    for seq, k in zip(out.seqs, out.num_samples):
        request = seq.request
        for j in range(k):
            rows.append(SampleRow((request.request_id, seq.index if k == 1 else j),
                                  request.prompt_token_ids, seq.num_output_tokens,
                                  request.stop_token_ids))
    return rows


__all__ = ["ModelRunner", "Released"]
