"""The device side of the engine: what runs one step's forward.

``ModelRunner`` owns the KV pool (sized by ``pool_sizing``, over the block bookkeeping the
engine's scheduler owns), builds each step's inputs
(``input_batch``), replays CUDA graphs (``cuda_graphs`` for decode, ``prefill_graphs`` for a step
of one prompt) and runs the model. With tensor parallelism, rank 0's ``TPExecutor``
(``tp_executor``) sends every other rank (``tp_worker``) the step's ``tp_messages``, under the
step budget of ``tp_watchdog``.
"""
