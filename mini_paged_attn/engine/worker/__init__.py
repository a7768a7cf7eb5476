"""The device side of the engine: ``ModelRunner`` and what runs one step's forward (inputs,
CUDA graphs, pool sizing, tensor-parallel ranks). The files: docs/architecture.md,
``engine/worker/``.
"""
