"""One-off measurements behind the kernels' choices (GPU): tile, split, layout and timing-method
experiments. Their findings are in docs/performance-notes.md, their rows in ``results/``. They
import the tools of ``benchmarks``; the tools never import them.
"""
