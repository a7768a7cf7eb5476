"""SamplingParams: how to pick each next token and when to stop (shaped like vLLM's)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..core.args import check_bool, is_int, is_number, positive_int
from .structured.params import StructuredOutputsParams

# Top logprobs a request may ask for per token (the sampler gathers them for the whole batch).
MAX_LOGPROBS = 20
# Temperatures below this are greedy: float32 logits divided by a tinier one overflow to inf
# (1e-40 is even a float32 zero), and the softmax of inf is NaN (vLLM uses the same bound).
GREEDY_TEMPERATURE = 1e-5
# OpenAI's ranges: penalties in [-2, 2], a logit bias in [-100, 100].
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0


@dataclass
class SamplingParams:
    """Sampling and stopping for one request.

    Args:
        temperature: >= 0; 0 (and anything below ``GREEDY_TEMPERATURE`` = 1e-5) is greedy
            (argmax). Logits are divided by it before softmax.
        top_p: in (0, 1]; keep the smallest set of most likely tokens whose probability sum
            reaches top_p.
        top_k: -1 or 0 (off, as in vLLM; 0 is stored as -1) or >= 1; keep the k most likely
            tokens.
        min_p: in [0, 1]; drop tokens less likely than min_p times the most likely one.
        max_tokens: >= 1; generate at most this many tokens per sample.
        stop: strings that end generation when they appear in the text (not included in it,
            unless ``include_stop_str_in_output``).
        stop_token_ids: token ids that end generation (included in token_ids; in the text only
            with ``include_stop_str_in_output``). The output's ``stop_reason`` says which
            string or id ended a sample.
        include_stop_str_in_output: the stop string, or the text of the stop token, that ended
            a sample ends its text too (vLLM's option; default False).
        skip_special_tokens: leave special tokens (eos, chat markers ...) out of the text
            (default True, as vLLM); token_ids hold them either way.
        ignore_eos: keep generating past the model's end-of-sequence tokens.
        n: >= 1 samples of the same prompt (they share the prompt's KV blocks).
        seed: makes this request's sampling reproducible (its own random generator).
        logprobs: None, or the number (0..20) of most likely tokens whose log-probabilities are
            returned per generated token, with the sampled token's (log-softmax of the model's
            logits before the penalties, the bias, temperature and filtering).
        presence_penalty: in [-2, 2]; subtracted once from the logit of every token the sample
            has generated so far (> 0: favours new tokens).
        frequency_penalty: in [-2, 2]; subtracted from a token's logit once per time the sample
            has generated it.
        repetition_penalty: > 0, 1 is off; tokens of the prompt or of the output have positive
            logits divided by it and negative ones multiplied by it (> 1: discourages repeats).
        logit_bias: ``{token_id: bias}`` added to those logits before sampling; biases in
            [-100, 100] (-100 in effect bans a token); token ids are checked against the
            vocabulary when the request is added.
        min_tokens: >= 0 and <= max_tokens; the end-of-sequence and stop_token_ids tokens cannot
            be sampled before this many tokens have been generated (stop strings still apply).
        prompt_logprobs: None, or the number (0..20) of most likely tokens whose
            log-probabilities are returned per prompt position, with the prompt token's own
            (``RequestOutput.prompt_logprobs``: None for the first position, which nothing
            predicts). Such a request never takes prefix-cache hits: every position's logits
            are computed.
        structured_outputs: None, or a :class:`StructuredOutputsParams` every sample's output
            must satisfy (JSON schema, JSON object, regex, choice or grammar; needs llguidance:
            ``pip install -e ".[structured]"``). The grammar masks the logits after the
            penalties and logit_bias, before temperature and filtering; a complete grammar
            allows only the end-of-sequence tokens (the sample then ends, even with
            ignore_eos). A min_tokens the grammar cannot reach ends the sample with "error".

    Raises:
        ValueError: naming the field, the expected range and the value given.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 16
    stop: str | list[str] | tuple[str, ...] | None = None
    stop_token_ids: list[int] | tuple[int, ...] | None = None
    ignore_eos: bool = False
    n: int = 1
    seed: int | None = None
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Whether the sampler must look at the sample's tokens (penalties, min_tokens), add a bias
    # or mask by a grammar: derived, so the common request costs the sampler one attribute read
    # per row.
    uses_history: bool = field(init=False, repr=False, compare=False, default=False)
    uses_logit_bias: bool = field(init=False, repr=False, compare=False, default=False)
    uses_processors: bool = field(init=False, repr=False, compare=False, default=False)
    # top-k, top-p or min-p filter the distribution; plain rows (no filter, processor or
    # logprobs) can be sampled in one pass over model-dtype logits.
    uses_filters: bool = field(init=False, repr=False, compare=False, default=False)
    plain: bool = field(init=False, repr=False, compare=False, default=False)

    def __post_init__(self) -> None:
        def fail(name: str, expected: str) -> ValueError:
            return ValueError(f"{name}: expected {expected}, got {getattr(self, name)!r}")

        if not is_number(self.temperature) or not 0 <= self.temperature < math.inf:
            raise fail("temperature", "a number >= 0 (0 is greedy)")
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise fail("top_p", "a number in (0, 1]")
        if not is_int(self.top_k) or not (self.top_k in (-1, 0) or self.top_k >= 1):
            raise fail("top_k", "-1 or 0 (off) or an int >= 1")
        # One spelling of "off" inside, so the sampler and the batch look at one value.
        self.top_k = -1 if self.top_k == 0 else int(self.top_k)
        if not is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise fail("min_p", "a number in [0, 1]")
        self.max_tokens = positive_int("max_tokens", self.max_tokens)
        self.n = positive_int("n", self.n)
        if self.seed is not None and not is_int(self.seed):
            raise fail("seed", "None or an int")
        if self.logprobs is not None and (not is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise fail("logprobs", f"None or an int in [0, {MAX_LOGPROBS}]")
        check_bool("ignore_eos", self.ignore_eos)
        check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        check_bool("skip_special_tokens", self.skip_special_tokens)
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise fail("stop", "None, a non-empty string or a list of non-empty strings")
        self.stop = tuple(stop)
        ids = () if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(is_int(t) and t >= 0 for t in ids):
            raise fail("stop_token_ids", "None or a list of non-negative ints")
        self.stop_token_ids = tuple(ids)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise fail(name, f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]")
        if not is_number(self.repetition_penalty) or not 0 < self.repetition_penalty < math.inf:
            raise fail("repetition_penalty", "a number > 0 (1 is off)")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise fail("min_tokens", f"an int in [0, max_tokens={self.max_tokens}]")
        if self.prompt_logprobs is not None and (
                not is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise fail("prompt_logprobs", f"None or an int in [0, {MAX_LOGPROBS}]")
        bias = {} if self.logit_bias is None else self.logit_bias
        if not isinstance(bias, dict) or not all(
                is_int(t) and t >= 0 and is_number(b) and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS
                for t, b in bias.items()):
            raise fail("logit_bias", f"None or a dict of token id (int >= 0) to a number in "
                                     f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        self.logit_bias = {int(t): float(b) for t, b in bias.items()} or None
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)
        self.min_p = float(self.min_p)
        self.presence_penalty = float(self.presence_penalty)
        self.frequency_penalty = float(self.frequency_penalty)
        self.repetition_penalty = float(self.repetition_penalty)
        self.uses_history = (self.uses_penalties or self.min_tokens > 0)
        self.uses_logit_bias = self.logit_bias is not None
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            raise fail("structured_outputs", "None or a StructuredOutputsParams")
        self.uses_processors = (self.uses_history or self.uses_logit_bias
                                or self.structured_outputs is not None)
        self.uses_filters = self.top_k != -1 or self.top_p < 1.0 or self.min_p > 0.0
        self.plain = not (self.uses_filters or self.uses_processors or self.logprobs is not None)

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def default_text(self) -> bool:
        """The text is made as usual: special tokens skipped, stop strings and tokens cut off
        (what an engine client may rebuild from token ids alone)."""
        return self.skip_special_tokens and not self.include_stop_str_in_output

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


__all__ = ["GREEDY_TEMPERATURE", "MAX_LOGIT_BIAS", "MAX_LOGPROBS", "MAX_PENALTY", "SamplingParams",
           "StructuredOutputsParams"]
