"""Starting the engine's child process, apart from the client that talks to it.

:class:`EngineProcess` spawns :func:`~.child.run_core_process` with its two pipes and nothing
else: this module and the child's entry point import no torch, so a server can start its
engine first and import its own stack (torch, transformers, the HTTP app) while the child
loads, instead of before; :class:`~.mp_client.MPEngineClient` then takes the started process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from dataclasses import dataclass
from typing import Any

from .child import CoreLaunch, run_core_process


@dataclass
class EngineProcess:
    """A started engine child: ``process``, the sending end of its command pipe
    (``commands``) and the receiving end of its result pipe (``results``)."""

    process: Any
    commands: Any
    results: Any

    @classmethod
    def start(cls, launch: CoreLaunch) -> EngineProcess:
        """Spawn the child that builds ``launch``'s engine (it says ``Loading`` / ``Ready``
        on ``results``)."""
        ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
        child_commands, commands = ctx.Pipe(duplex=False)  # (receiving, sending) ends
        results, child_results = ctx.Pipe(duplex=False)
        # A daemonic process may not start children, and a tensor-parallel engine starts its
        # other ranks: that core is not a daemon, and the client's shutdown (or its pipe's
        # end, when this process dies) stops it.
        daemon = launch.llm_kwargs.get("tensor_parallel_size", 1) == 1
        process = ctx.Process(target=run_core_process, name="engine-core", daemon=daemon,
                              args=(launch, child_commands, child_results))
        process.start()
        child_commands.close()
        child_results.close()
        return cls(process, commands, results)

    def stop(self, timeout: float) -> None:
        """Wait ``timeout`` seconds for the child to exit, then kill it."""
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

    def close(self) -> None:
        """Stop the child at once and close the pipes (a process started for nothing)."""
        self.stop(0)
        self.commands.close()
        self.results.close()


def cuda_likely(device: str | None) -> bool:
    """Whether this host probably runs the engine on CUDA, without importing torch: the
    ``device`` asked for, else an NVIDIA driver that lists a GPU and a ``CUDA_VISIBLE_DEVICES``
    that hides none of them all. A hint for starting the engine's process early; torch's
    ``cuda.is_available()`` still decides (see ``commands/serve.py``)."""
    if device is not None:
        return device.startswith("cuda")
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    try:
        return bool(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return False


__all__ = ["EngineProcess", "cuda_likely"]
