"""The paged KV cache on the device: the pool of every layer, its block tables and its
copy-on-write copies (``PagedAttentionManager``). The files: docs/architecture.md, ``cache/``.
"""
