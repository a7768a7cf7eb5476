"""Block bookkeeping and scheduling in pure Python, no torch: which blocks hold what, who
runs each step. The files: docs/architecture.md, ``core/``.
"""
