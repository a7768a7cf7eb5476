"""From a step's logits to its tokens, on the device: the ``Sampler`` (greedy, temperature,
top-k/p, min-p, seeds, logprobs), what it applies first (``penalties``: min_tokens, logit_bias,
presence/frequency/repetition) and the rows of prompt logprobs (``prompt_logprobs``). Grammar
masks of structured outputs come from :mod:`mini_paged_attn.engine.structured`.
"""
