"""Speculator: which sequences get proposals after a step, from which proposer, and what the
verifications kept (the counters of ``LLMEngine.stats()``).

Proposals are made once a step's tokens are known on the host (a synchronous step: see
``LLMEngine._mode``) for every running sequence that decodes next and whose request can be
served exactly (:func:`speculates`), while the running set holds at most
``disable_by_batch_size`` sequences; the next ``Scheduler.schedule`` gives each its token and
the proposals to verify in one step.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ...core.ngram import NgramProposer
from ...core.request import Sequence
from ..sampling_params import SamplingParams
from .config import SpeculativeConfig
from .verify import Verified, VerifyRows

if TYPE_CHECKING:
    from .draft import DraftProposer

logger = logging.getLogger(__name__)


def speculates(params: SamplingParams) -> bool:
    """Whether a request's samples may verify proposals: what it asks the sampler for must be
    the same at every position of a verified run. Not for penalties or min_tokens (they read
    the sample's tokens so far, which differ row by row), logprobs (their entries are made by
    the sampler from its own rows), prompt logprobs (a draft model would compute them too),
    structured outputs (the grammar's masks follow the accepted tokens), nor a seed with a
    temperature (a seeded sample's draws come from its own generator, one per token, so that
    it is the same in any batch; verification draws from the engine's). Such a request decodes
    one token a step beside the others."""
    return not (params.uses_history or params.logprobs is not None
                or params.prompt_logprobs is not None
                or params.structured_outputs is not None
                or (params.seed is not None and not params.greedy))


class Speculator:
    """Proposes for the engine's decoding sequences and counts what was kept.

    Args:
        config: the engine's :class:`SpeculativeConfig`.
        draft: the draft model's proposer (:class:`~.draft.DraftProposer`) for method
            "draft_model"; None for "ngram".
        max_model_len: the engine's maximum sequence length.
    """

    def __init__(self, config: SpeculativeConfig, max_model_len: int,
                 draft: DraftProposer | None = None) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.ngram = (NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
                      if config.method == "ngram" else None)
        self.draft = draft
        # Counters: steps that verified, sequences' verifications, tokens proposed, kept.
        self.num_steps = 0
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def active(self, num_running: int) -> bool:
        """Whether a batch of ``num_running`` running sequences speculates."""
        return num_running <= self.config.disable_by_batch_size

    def _room(self, seq: Sequence) -> int:
        """Proposals the sequence can verify: it keeps room for the verification's own token
        before its max_tokens and max_model_len."""
        request = seq.request
        max_len = min(self.max_model_len, request.num_prompt_tokens + request.max_tokens)
        return min(self.k, max_len - len(seq.token_ids) - 1)

    def propose(self, running: list[Sequence]) -> None:
        """Set ``spec_token_ids`` of each running sequence that decodes next and speculates
        (see :func:`speculates`), if the batch is small enough (:meth:`active`); forget the
        proposer state of sequences no longer running."""
        if self.ngram is not None:
            self.ngram.retain({seq.seq_id for seq in running})
        if not self.active(len(running)):
            if self.draft is not None:
                self.draft.retain([])     # a step this large frees the draft's blocks
            return
        chosen, room = [], []
        for seq in running:
            k = self._room(seq)
            if (k > 0 and seq.num_computed_tokens == len(seq.token_ids) - 1
                    and not seq.request.paused and speculates(seq.request.params)):
                chosen.append(seq)
                room.append(k)
        if self.ngram is not None:
            for seq, k in zip(chosen, room):
                seq.spec_token_ids = self.ngram.propose(seq.seq_id, seq.token_ids, k)
            return
        self.draft.retain(running)
        for seq, proposals in zip(chosen, self.draft.propose(chosen, room)):
            seq.spec_token_ids = proposals

    def record(self, rows: VerifyRows, verified: Verified) -> None:
        """Count one step's verifications."""
        self.num_steps += 1
        self.num_drafts += len(rows.proposals)
        self.num_draft_tokens += sum(len(p) for p in rows.proposals)
        self.num_accepted_tokens += sum(verified.num_accepted)


def build_speculator(config: SpeculativeConfig | None, max_model_len: int,
                     draft: DraftProposer | None = None) -> Speculator | None:
    """The engine's speculator for ``config`` (None: none); ``draft``: the draft model's
    proposer, for method "draft_model"."""
    if config is None:
        return None
    assert (draft is not None) == (config.method == "draft_model"), config
    logger.info("speculative decoding: %s, %d tokens a step", config.method,
                config.num_speculative_tokens)
    return Speculator(config, max_model_len, draft)


__all__ = ["Speculator", "build_speculator", "speculates"]
