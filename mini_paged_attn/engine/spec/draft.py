"""The draft model of method "draft_model": a smaller model of the target's vocabulary that
proposes each sequence's next k tokens greedily.

The draft runs on a :class:`~mini_paged_attn.engine.worker.model_runner.ModelRunner` of its
own (its own layers, KV pool, block tables, CUDA graphs and warm-up), over block bookkeeping of
its own (a :class:`~mini_paged_attn.core.kv_cache_manager.KVCacheManager` without prefix
caching, which keeps every block of a sequence even under a sliding window: the window is the
kernels' mask). Each target sequence that speculates has a shadow :class:`Sequence` in it, holding
the K/V of the tokens the draft has seen.

One proposal round (:meth:`DraftProposer.propose`):

1. **Catch up.** The shadow's cached tokens that the target sequence no longer has (the
   proposals the target rejected) are cut off (``KVCacheManager.truncate``), and the target's
   tokens past what the shadow holds are computed (a prompt in chunks of at most
   ``max_num_batched_tokens``; after a verification, the one to k + 1 tokens it added). The
   logits of the last one give the first proposal.
2. **Draft.** k - 1 decode steps, each feeding the previous proposal (a decode-only step:
   the draft's CUDA graphs replay it on a GPU).

The shadow then holds the target's tokens and the first k - 1 proposals; what the target
keeps of them stays cached for the next round. Its blocks are sized with the pool of the
target (``EngineConfig.num_kv_blocks`` blocks, plus one a sequence for its proposals): a
sequence for which no room is left gets no proposals that step, never an error.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from ...core.block_manager import BlockManager
from ...core.kv_cache_manager import KVCacheManager
from ...core.request import Sequence
from ...core.scheduler import SchedulerOutput
from ...models.config import ModelConfig
from ..config import EngineConfig
from ..sample.penalties import add_logit_bias

logger = logging.getLogger(__name__)


def load_draft_model(path: str | Path, target_config: ModelConfig, *, dtype: torch.dtype,
                     device: torch.device):
    """The draft's ``(CausalLM, ModelConfig)``, in the target's dtype and on its device.

    Raises:
        ValueError: naming ``speculative_config.model`` when the draft's vocabulary size
            differs from the target's (both sizes given).
        FileNotFoundError: as ``models.loader.load_model``.
    """
    from ...models.loader import TINY_MODEL, load_model
    from ...models.packaged import resolve_model
    if str(path) == TINY_MODEL:
        from ...models.tiny import tiny_llama
        model, config, _ = tiny_llama(device, dtype)
    else:
        model, config = load_model(resolve_model(path), dtype=dtype, device=device)
    if config.vocab_size != target_config.vocab_size:
        raise ValueError(f"speculative_config.model: expected a draft model of the target's "
                         f"vocabulary ({target_config.vocab_size} tokens), got {path!r} with "
                         f"{config.vocab_size}")
    return model, config


class DraftProposer:
    """Greedy proposals of a draft model, for the engine's :class:`~.speculator.Speculator`.

    Args:
        model, model_config: the draft (:func:`load_draft_model`).
        config: the engine's config; the draft's runner takes it with no speculation, no
            cascade attention, ``max_num_seqs`` capped at ``disable_by_batch_size`` (no more
            sequences ever speculate in one step) and ``num_blocks`` blocks.
        max_model_len: the engine's maximum sequence length.
        num_blocks: the target's pool size in blocks; the draft's pool gets one more a
            sequence (the room its proposals take past the target's tokens).
    """

    def __init__(self, model, model_config: ModelConfig, config: EngineConfig,
                 max_model_len: int, num_blocks: int) -> None:
        from ..worker.model_runner import ModelRunner
        spec = config.speculative_config
        assert spec is not None and spec.method == "draft_model", spec
        self.k = spec.num_speculative_tokens
        max_seqs = min(config.max_num_seqs, spec.disable_by_batch_size)
        draft_config = dataclasses.replace(
            config, speculative_config=None, cascade_attention=False, max_num_seqs=max_seqs,
            num_kv_blocks=num_blocks + max_seqs, enable_prefix_caching=False,
            async_scheduling=False)
        self.runner = ModelRunner(model, model_config, draft_config, max_model_len)
        self.kv = KVCacheManager(BlockManager(self.runner.num_blocks), config.block_size,
                                 False, None)
        self.runner.build_cache(self.kv)
        self.max_num_batched_tokens = draft_config.max_num_batched_tokens
        self._shadows: dict[int, Sequence] = {}    # target seq_id -> the draft's sequence
        self._next_id = 0

    # ---- the shadows ------------------------------------------------------------------------
    def _free(self, seq_id: int) -> None:
        shadow = self._shadows.pop(seq_id)
        self.kv.free(shadow)
        self.runner.release(shadow.seq_id)

    def retain(self, running: list[Sequence]) -> None:
        """Drop the shadows of sequences not among ``running`` (finished, preempted, or
        every one when the step does not speculate): their blocks go back to the pool."""
        keep = {(seq.seq_id, id(seq.request)) for seq in running}
        for seq_id, shadow in list(self._shadows.items()):
            if (seq_id, id(shadow.request)) not in keep:
                self._free(seq_id)

    def _shadow(self, seq: Sequence, k: int) -> tuple[Sequence, int] | None:
        """``seq``'s shadow, cut back to the tokens it shares with ``seq`` and given room for
        the rest of ``seq``'s tokens and ``k - 1`` proposals, and how many tokens it must
        compute; None when the pool has no room (the shadow is dropped then)."""
        target = seq.token_ids
        shadow = self._shadows.get(seq.seq_id)
        if shadow is None:
            shadow = Sequence(self._next_id, seq.request, seq.index, [])
            self._next_id += 1
            self._shadows[seq.seq_id] = shadow
        cached = shadow.num_computed_tokens
        same = 0
        limit = min(cached, len(target) - 1)
        old = shadow.token_ids
        while same < limit and old[same] == target[same]:
            same += 1
        if same < cached:
            self.kv.truncate(shadow, same)
        shadow.token_ids = list(target)
        need = len(target) - same
        if self.kv.allocate_slots(shadow, need, num_lookahead_tokens=k - 1) is None:
            self._free(seq.seq_id)
            return None
        return shadow, need

    # ---- proposing ---------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], room: list[int]) -> list[list[int]]:
        """Greedy proposals for each of ``seqs`` (target sequences whose last token the
        target has not computed yet), ``room[i]`` of them (1 .. k) for ``seqs[i]``; an empty
        list for a sequence the draft's pool has no room for."""
        proposals: list[list[int]] = [[] for _ in seqs]
        live: list[tuple[int, Sequence, int]] = []     # (index, shadow, tokens left to compute)
        for i, (seq, k) in enumerate(zip(seqs, room)):
            got = self._shadow(seq, k)
            if got is not None:
                live.append((i, *got))
        # Catch up, in steps of at most max_num_batched_tokens tokens; a sequence whose chunk
        # reaches its last token samples its first proposal.
        while live:
            budget, chunk, waiting = self.max_num_batched_tokens, [], []
            for i, shadow, left in live:
                take = min(left, budget)
                budget -= take
                if take:
                    chunk.append((i, shadow, take, take == left))
                if take < left:
                    waiting.append((i, shadow, left - take))
            ids = iter(self._step([s for _, s, _, _ in chunk], [t for _, _, t, _ in chunk],
                                  [int(last) for _, _, _, last in chunk]))
            for i, shadow, _, last in chunk:
                if last:
                    token = next(ids)
                    proposals[i].append(token)
                    shadow.token_ids.append(token)
            live = waiting
        # Draft: each decode step feeds the previous proposal.
        for j in range(1, max(room, default=0)):
            rows = [(i, self._shadows[seqs[i].seq_id]) for i in range(len(seqs))
                    if len(proposals[i]) == j and room[i] > j]
            if not rows:
                break
            ids = self._step([s for _, s in rows], [1] * len(rows), [1] * len(rows))
            for (i, shadow), token in zip(rows, ids):
                proposals[i].append(token)
                shadow.token_ids.append(token)
        return proposals

    def _step(self, shadows: list[Sequence], num_new: list[int],
              num_samples: list[int]) -> list[int]:
        """One forward of the draft over ``shadows`` (each computing its next ``num_new``
        tokens, which its blocks have room for); the argmax token of each that samples,
        after its request's logit_bias (which the target applies before it judges)."""
        out = SchedulerOutput(seqs=shadows, num_new_tokens=num_new, num_samples=num_samples,
                              num_batched_tokens=sum(num_new))
        logits = self.runner.forward(out)
        for shadow, n in zip(shadows, num_new):
            shadow.num_computed_tokens += n
        if logits is None:
            return []
        params = [s.request.params for s, n in zip(shadows, num_samples) if n]
        biased = [row for row, p in enumerate(params) if p.uses_logit_bias]
        if biased:
            logits = logits.float()
            add_logit_bias(logits, biased, [params[row].logit_bias for row in biased])
        return logits.argmax(dim=-1).tolist()

    def release_memory(self) -> None:
        """Give back the draft's device memory (``ModelRunner.release_memory``)."""
        self._shadows.clear()
        self.runner.release_memory()


__all__ = ["DraftProposer", "load_draft_model"]
