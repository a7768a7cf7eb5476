"""A tensor-parallel rank other than 0: load its shard, then run every step rank 0 sends.

The worker is a child process (``spawn``) with a pipe to rank 0. It says ``("ready", None)``
once its shard and KV pool exist (or ``("error", text)`` and exits), then loops: receive a
:class:`~mini_paged_attn.engine.worker.tp_messages.StepMessage`, run :meth:`ModelRunner.execute_message`. It leaves the
loop on a :class:`~mini_paged_attn.engine.worker.tp_messages.StopMessage`, when rank 0's end of the pipe closes (rank 0
exited, however it exited), or after a failed step (reported on the pipe first). Ctrl-C is
ignored here: rank 0 hears it and stops the workers.

A worker's pool keeps no block bookkeeping (:func:`build_worker_runner`): rank 0's scheduler
allocates every block, and each step message names the copies to make.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
from dataclasses import dataclass
from typing import Any

import torch

from ..config import EngineConfig, resolve_max_model_len
from .tp_messages import StopMessage

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerLaunch:
    """What a worker needs to join the group and build its runner.

    Attributes:
        model_dir: the Hugging Face model directory every rank reads its shard from.
        dtype: as for ``load_model``.
        device: this rank's device ("cuda:1", "cpu", ...).
        config: the engine config (the same on every rank, so pools and graphs match).
        rank, world_size: this rank and the tensor-parallel size.
        host, port: rank 0's rendezvous store.
    """

    model_dir: str
    dtype: str
    device: str
    config: EngineConfig
    rank: int
    world_size: int
    host: str
    port: int


def run_worker(launch: WorkerLaunch, conn: Any) -> None:
    """The worker process's entry point (see the module doc); ``conn``: its pipe end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    device = torch.device(launch.device)
    if device.type == "cpu":
        # The ranks share the host's cores: without this each would start one thread per core.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // launch.world_size))
    tp = None
    try:
        from ...distributed.group import init_tp_group
        from ...models.loader import load_model

        tp = init_tp_group(launch.rank, launch.world_size, device, host=launch.host,
                           port=launch.port, timeout_s=launch.config.distributed_timeout_s)
        model, model_config = load_model(launch.model_dir, dtype=launch.dtype, device=device,
                                         tp=tp)
        max_len = resolve_max_model_len(launch.config, model_config.max_position_embeddings)
        runner = build_worker_runner(model, model_config, launch.config, max_len)
    except BaseException as exc:
        logger.exception("tensor-parallel rank %d could not start", launch.rank)
        _report(conn, f"{type(exc).__name__}: {exc}")
        return
    conn.send(("ready", None))
    clean = False
    try:
        clean = _serve(runner, conn, launch.rank)
    finally:
        if clean:
            # The device is idle: drop the graphs, which the group's teardown waits for.
            # After a failed step a collective may never finish, so no synchronize then.
            runner.release_graphs()
        tp.close()


def build_worker_runner(model, model_config, config: EngineConfig, max_model_len: int):
    """This rank's :class:`~mini_paged_attn.engine.worker.model_runner.ModelRunner`: its pool is
    sized with rank 0's (the sizing agrees on the smallest) but keeps no block bookkeeping,
    since rank 0's scheduler allocates every block and each step message names the copies."""
    from .model_runner import ModelRunner

    runner = ModelRunner(model, model_config, config, max_model_len)
    runner.build_cache(None)
    return runner


def _serve(runner, conn: Any, rank: int) -> bool:
    """Run rank 0's steps until told to stop (True) or until rank 0 is gone or a step
    fails (False)."""
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):      # rank 0 is gone
            return False
        if isinstance(message, StopMessage):
            return True
        try:
            runner.execute_message(message)
        except BaseException as exc:
            logger.exception("tensor-parallel rank %d: step failed", rank)
            _report(conn, f"{type(exc).__name__}: {exc}")
            return False


def _report(conn: Any, text: str) -> None:
    try:
        conn.send(("error", text))
    except OSError:                       # rank 0 is gone: nobody to tell
        pass


__all__ = ["WorkerLaunch", "build_worker_runner", "run_worker"]
