"""Exceptions raised by mini_paged_attn.

Each error is raised before any state changes, so a caller can catch it and go on.
"""


class OutOfBlocksError(MemoryError):
    """The block pool has fewer free blocks than a call needs."""


class BlockStateError(RuntimeError):
    """A block was used in a state that does not allow it (e.g. freeing a free block)."""


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died or the ranks fell out of step: the engine cannot go on
    (every later step raises this too); shut it down and build a new one."""


class ModelLoadError(ValueError):
    """A model directory exists but cannot be loaded: a truncated or unreadable weights file,
    a config.json that is not JSON. The message names the file and what is wrong with it."""
