"""Integrations with other libraries: a leaf layer that imports only :mod:`mini_paged_attn.ops`.

- :mod:`.hf_attention`: a transformers attention function over :func:`flash_attn_varlen_func`.
- :mod:`.hf_paged`: its ``paged|`` form for transformers' continuous batching (5.17 tested; 5.22 and later refuse custom implementations there),
  :func:`paged_prefill` over transformers' paged cache.
- :mod:`.transformers`: registers them with transformers (``attn_implementation="mini_paged_attn"``).
"""
