"""Benchmark tools, each run from the repository root as ``python -m benchmarks.<tool> --help``.

Experiments behind the kernels' choices live in ``benchmarks.experiments``; they may import
the tools here, never the reverse.
"""
