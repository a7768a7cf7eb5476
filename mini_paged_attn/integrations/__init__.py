"""Integrations with other libraries: a leaf layer that imports only :mod:`mini_paged_attn.ops`.

- :mod:`.hf_attention`: a transformers attention function over :func:`flash_attn_varlen_func`.
- :mod:`.transformers`: registers it with transformers as ``attn_implementation="mini_paged_attn"``.
"""
