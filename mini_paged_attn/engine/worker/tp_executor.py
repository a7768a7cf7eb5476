"""Rank 0's side of tensor parallelism: start the other ranks, send them each step, stop them.

Processes: rank 0 is the caller's process (it holds the scheduler, the block manager, the
tokenizer and the sampler); ranks ``1 .. N-1`` are ``spawn``-ed children running
:func:`~mini_paged_attn.engine.worker.tp_worker.run_worker`, one pipe each. The ranks join one process group (gloo on
CPU, NCCL on CUDA with ``cuda:r`` for rank ``r``) for the all-reduces inside the layers and the
logits gather; the per-step inputs go down the pipes, pickled once per step.

Failures: before each step every worker is checked alive (a dead one makes the step raise
:class:`~mini_paged_attn.errors.TensorParallelError` at once, naming the rank and its exit
code); a rank dying inside a step breaks the collective on rank 0 (gloo sees the closed
socket; NCCL waits out ``distributed_timeout_s``), which raises the same error. A rank that
is alive but does not take part (stopped with SIGSTOP, hung) would hold the step until the
group's own timeout: a :class:`~mini_paged_attn.engine.worker.tp_watchdog.StepWatchdog` gives each step
``step_timeout_s``, then kills the workers, which breaks the step's collective the same way
and names the stalled ranks. After one failure the engine stays failed. :meth:`TPWorkers.close` (``LLM.shutdown()``, garbage
collection, interpreter exit) stops every worker: a stop message, then terminate, then kill.
"""

from __future__ import annotations

import logging
import pickle
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable
from multiprocessing import util as mp_util
from pathlib import Path
from typing import Any, NoReturn

import torch

from ...distributed.group import TPGroup, init_tp_group, serve_store
from ...distributed.sharding import check_tensor_parallel_size
from ...errors import TensorParallelError
from ..config import EngineConfig, resolve_max_model_len
from .tp_messages import StepMessage, StopMessage
from .tp_watchdog import StepWatchdog
from .tp_worker import WorkerLaunch, run_worker

logger = logging.getLogger(__name__)

STORE_HOST = "127.0.0.1"
# Seconds a stopping worker gets to leave on its own, then after terminate().
STOP_GRACE_S = 5.0
# How long to look for a dead worker after a failed step (its exit may lag the broken socket).
DEATH_POLL_S = 2.0
# multiprocessing runs finalizers with a priority before it joins the children at exit.
EXIT_PRIORITY = 100


class TPWorkers:
    """The running ranks ``1 .. N-1`` (see the module doc). Build with
    :func:`start_tensor_parallel`."""

    def __init__(self, processes: list, conns: list, tp: TPGroup, cleanup: list[Path],
                 step_timeout_s: float | None = None) -> None:
        self.processes = processes
        self.conns = conns
        self.tp = tp
        self._error: str | None = None
        # Weakly: the watchdog's thread must not keep the workers from garbage collection.
        me = weakref.ref(self)
        self._watchdog = (None if step_timeout_s is None else StepWatchdog(
            step_timeout_s, processes, lambda text: (w := me()) is not None and w._stalled(text)))
        # Rank 0's CUDA graph holders, weakly: destroyed before the group closes (_stop).
        self._graphs: list[weakref.ref] = []
        # Close at garbage collection and at interpreter exit (before multiprocessing joins
        # its children, which would wait forever on running workers).
        self._finalizer = mp_util.Finalize(
            self, _stop, args=(processes, conns, tp, cleanup, self._graphs, self._watchdog),
            exitpriority=EXIT_PRIORITY)

    @property
    def failed(self) -> bool:
        """A rank died or stalled: the group can run no more steps."""
        return self._error is not None

    @property
    def world_size(self) -> int:
        return self.tp.world_size

    def track_graphs(self, holder) -> None:
        """Have :meth:`close` (also at garbage collection) call ``holder.release()``, which
        synchronizes and destroys rank 0's CUDA graphs, before the NCCL group closes: NCCL's
        teardown waits while graphs that captured its collectives exist. Held weakly; never
        called once the ranks failed (a collective of the failed step may never finish)."""
        self._graphs.append(weakref.ref(holder))

    def check(self) -> None:
        """Raise :class:`TensorParallelError` if a worker has died or a step failed before."""
        if self._error is None:
            dead = dead_ranks(self.processes, self.conns)
            if dead:
                self._set_error(dead)
        if self._error is not None:
            raise TensorParallelError(self._error)

    def send(self, message: StepMessage) -> None:
        """Send one step's inputs to every worker (after :meth:`check`); the step's time
        budget starts here and ends at :meth:`step_done`."""
        self.check()
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        if self._watchdog is not None:
            self._watchdog.arm()
        try:
            for conn in self.conns:
                conn.send_bytes(data)
        except OSError as exc:
            self.step_done()
            self._fail(f"could not send a step to a worker: {exc}", exc)

    def step_done(self) -> None:
        """The step :meth:`send` started is over on rank 0 (finished or failed)."""
        if self._watchdog is not None:
            self._watchdog.disarm()

    def _stalled(self, text: str) -> None:
        """The watchdog's verdict (on its thread, before it kills the workers)."""
        logger.error("%s", text)
        self._set_error(self._error or text)

    def check_after_failure(self, exc: BaseException) -> None:
        """A step's forward raised on rank 0: the ranks are out of step from now on. Raises
        :class:`TensorParallelError` naming a worker that died (waiting a moment for one) or
        else the failure itself."""
        dead = _wait_for_dead(self.processes, self.conns, exc)
        self._fail(dead or f"a step failed on rank 0 ({type(exc).__name__}: {exc}), so the "
                           "ranks are out of step", exc)

    def wait_ready(self, timeout_s: float) -> None:
        """Wait for every worker's ready word (call it after rank 0 built its runner: building
        one has collectives every rank joins). Raises TensorParallelError naming a worker
        that failed or did not start in time."""
        deadline = time.monotonic() + timeout_s
        for rank, (process, conn) in enumerate(zip(self.processes, self.conns), start=1):
            while not conn.poll(0.05):
                if not process.is_alive():
                    self.check()
                if time.monotonic() > deadline:
                    self._fail(f"tensor-parallel worker rank {rank} did not start within "
                               f"{timeout_s:.0f} s", TimeoutError())
            kind, text = conn.recv()
            if kind != "ready":
                self._fail(f"tensor-parallel worker rank {rank} could not start: {text}",
                           RuntimeError(text))

    def close(self) -> None:
        """Stop every worker and wait for it to exit (idempotent)."""
        self._finalizer()

    def close_after_failure(self, exc: BaseException) -> NoReturn:
        """Starting the engine failed with ``exc``: stop the workers and raise, naming a worker
        that died (a worker failing to start breaks rank 0's rendezvous or first collective:
        what the worker said is the useful part), else ``exc`` itself."""
        self._graphs.clear()        # a failed start may have left a collective unfinished
        _close_after_failure(self.processes, self.conns, exc, self.close)

    def _fail(self, text: str, cause: BaseException) -> None:
        self._set_error(self._error or text)
        raise TensorParallelError(self._error) from cause

    def _set_error(self, text: str) -> None:
        self._error = text
        self._graphs.clear()        # see track_graphs


def dead_ranks(processes: list, conns: list) -> str | None:
    """A description of the dead workers (with what they reported on their pipes), or None."""
    dead = []
    for rank, (process, conn) in enumerate(zip(processes, conns), start=1):
        if process.is_alive():
            continue
        said = _last_error(conn)
        dead.append(f"rank {rank} (pid {process.pid}) exited with code {process.exitcode}"
                    + (f": {said}" if said else ""))
    if not dead:
        return None
    return "tensor-parallel worker " + "; ".join(dead) + "; shut the engine down"


def start_tensor_parallel(model: str | Path, *, dtype: str, device: str | None,
                          config: EngineConfig):
    """Start ranks ``1 .. N-1`` and load rank 0's shard here.

    Args:
        model: a model directory or ``"tiny"`` (written to a temporary directory every rank
            reads, removed at shutdown).
        dtype, device: as for ``LLMEngine.from_model``; on CUDA rank ``r`` uses GPU
            ``index + r`` of ``device`` (``cuda`` = ``cuda:0``).
        config: the engine config; ``tensor_parallel_size`` ranks in all.

    Returns:
        ``(model, model_config, tokenizer, workers)``: rank 0's shard and the workers.

    Raises:
        ValueError: the size does not divide the model's attention heads (or cannot split its
            KV heads / MLP), or exceeds the GPUs, before any process starts.
        TensorParallelError: a worker could not start (its error is in the message).
    """
    from ...models.config import ModelConfig
    from ...models.loader import TINY_MODEL, load_model
    from ...models.tokenizer import load_tokenizer

    n = config.tensor_parallel_size
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    devices = _rank_devices(device, n)
    cleanup: list[Path] = []
    tiny = str(model) == TINY_MODEL
    if tiny:
        from ...models.tiny import tiny_llama_config
        model_config = tiny_llama_config()
    else:
        model_config = ModelConfig.from_model_dir(model)
    check_tensor_parallel_size(n, model_config.num_q_heads, model_config.num_kv_heads,
                               model_config.intermediate_size)
    resolve_max_model_len(config, model_config.max_position_embeddings)   # raises if too long
    if tiny:
        from ...models.tiny import write_tiny_llama
        tmp = Path(tempfile.mkdtemp(prefix="mini-paged-attn-tiny-"))
        cleanup.append(tmp)
        model = write_tiny_llama(tmp)
    model_dir = str(model)
    store = serve_store(n, config.distributed_timeout_s, STORE_HOST)
    ctx = torch.multiprocessing.get_context("spawn")
    processes, conns = [], []
    workers = None
    try:
        for rank in range(1, n):
            launch = WorkerLaunch(model_dir, dtype, str(devices[rank]), config, rank, n,
                                  STORE_HOST, store.port)
            ours, theirs = ctx.Pipe()
            # Not a daemon: the server runs the engine in a daemonic process, which may not
            # have daemonic children; TPWorkers stops them instead.
            process = ctx.Process(target=run_worker, args=(launch, theirs),
                                  name=f"tp-rank-{rank}", daemon=False)
            process.start()
            theirs.close()
            processes.append(process)
            conns.append(ours)
        tp = init_tp_group(0, n, devices[0], host=STORE_HOST, port=store.port,
                           timeout_s=config.distributed_timeout_s, store=store)
        workers = TPWorkers(processes, conns, tp, cleanup, config.step_timeout_s)
        net, model_config = load_model(model_dir, dtype=dtype, device=devices[0], tp=tp)
        tokenizer = load_tokenizer(model_dir)
        return net, model_config, tokenizer, workers
    except BaseException as exc:
        if workers is not None:
            workers.close_after_failure(exc)
        _close_after_failure(processes, conns, exc,
                             lambda: _stop(processes, conns, None, cleanup, []))


def _rank_devices(device: torch.device, n: int) -> list[torch.device]:
    if device.type != "cuda":
        return [device] * n
    first = device.index or 0
    count = torch.cuda.device_count()
    if first + n > count:
        raise ValueError(f"tensor_parallel_size: expected at most {count - first} (GPUs from "
                         f"{device} on), got {n}")
    return [torch.device("cuda", first + r) for r in range(n)]


def _close_after_failure(processes: list, conns: list, exc: BaseException,
                         close: Callable[[], None]) -> NoReturn:
    dead = None if isinstance(exc, ValueError) else _wait_for_dead(processes, conns, exc)
    close()
    if dead:
        raise TensorParallelError(dead) from exc
    raise exc


def _wait_for_dead(processes: list, conns: list, exc: BaseException) -> str | None:
    """:func:`dead_ranks`, after up to DEATH_POLL_S for a worker whose death broke a
    collective (``exc``) to be seen as exited."""
    deadline = time.monotonic() + DEATH_POLL_S
    comm_error = (isinstance(exc, (RuntimeError, OSError))
                  and not isinstance(exc, TensorParallelError))
    dead = dead_ranks(processes, conns)
    while not dead and comm_error and time.monotonic() < deadline:
        time.sleep(0.05)
        dead = dead_ranks(processes, conns)
    return dead


def _last_error(conn: Any) -> str | None:
    """What a dead worker said last on its pipe, if it said anything."""
    text = None
    try:
        while conn.poll():
            kind, said = conn.recv()
            if kind == "error":
                text = said
    except (EOFError, OSError):
        pass
    return text


def _stop(processes: list, conns: list, tp: TPGroup | None, cleanup: list[Path],
          graphs: list[weakref.ref], watchdog: StepWatchdog | None = None) -> None:
    """Release rank 0's CUDA graphs that are still alive (see TPWorkers.track_graphs); stop
    the workers: a stop message, then terminate, then kill; close the group."""
    if watchdog is not None:
        watchdog.close()
    for ref in graphs:          # first: the order that stopped cleanly on two GPUs
        holder = ref()
        if holder is not None:
            holder.release()
    stop = pickle.dumps(StopMessage())
    for process, conn in zip(processes, conns):
        if process.is_alive():
            try:
                conn.send_bytes(stop)
            except OSError:
                pass
    deadline = time.monotonic() + STOP_GRACE_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            logger.warning("tensor-parallel worker %s did not stop; terminating it", process.name)
            process.terminate()
            process.join(STOP_GRACE_S)
        if process.is_alive():
            process.kill()
            process.join()
    for conn in conns:
        conn.close()
    if tp is not None:
        tp.close()
    for path in cleanup:
        shutil.rmtree(path, ignore_errors=True)


__all__ = ["TPWorkers", "dead_ranks", "start_tensor_parallel"]
