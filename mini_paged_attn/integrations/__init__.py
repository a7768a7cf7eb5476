"""Integrations with other libraries: a leaf layer over :mod:`mini_paged_attn.ops`, that
registers our attention with transformers (``attn_implementation="mini_paged_attn"`` and its
``paged|`` form; transformers 5.17 tested, 5.22 and later refuse custom implementations in
continuous batching). The files: docs/architecture.md, ``integrations/``.
"""
