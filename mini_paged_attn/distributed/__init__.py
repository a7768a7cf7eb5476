"""Tensor parallelism: the rank group handed down to the layers, and how a model is split.

Nothing here is global: a :class:`TPGroup` is built once per process and passed explicitly to
the model and the engine. With one rank every collective is the identity, so TP=1 runs exactly
the single-process arithmetic.
"""

from .group import TPGroup, init_tp_group
from .sharding import ShardLayout, check_tensor_parallel_size

__all__ = ["ShardLayout", "TPGroup", "check_tensor_parallel_size", "init_tp_group"]
