"""From a step's logits to its tokens, on the device: the ``Sampler``, the penalties it applies
first, and prompt logprobs. The files: docs/architecture.md, ``engine/sample/``.
"""
