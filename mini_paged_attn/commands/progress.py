"""What the command line shows while a model loads, and how many CPU threads torch gets.

:class:`LoadProgressBar` is the ``load_progress`` callback of ``LLM``: one tqdm bar over the
whole load (config, tokenizer, weights tensor by tensor, KV pool, CUDA graphs, warm-up), its
total growing as each phase says how many units it has, and on close the line of where the
time went. Any command that builds an ``LLM`` can pass one (``serve`` included).

:func:`cpu_threads` is the ``--threads`` default: torch starts one intra-op thread per core,
and on a machine whose cores are busy with other work those threads wait on each other at
every op, and fewer threads run faster; on an idle machine all of them win
(docs/performance-notes.md, "Figures behind the code's rules"). ``auto`` halves the threads
when the load average says every core is busy.
"""

from __future__ import annotations

import os
import sys
from typing import IO

from mini_paged_attn.models.load_progress import LoadEvent


class LoadProgressBar:
    """A tqdm bar fed by :class:`LoadEvent` s; ``disable=None`` (tqdm's): drawn only on a
    terminal. Use as a context manager, or call :meth:`close`."""

    def __init__(self, *, file: IO[str] | None = None, disable: bool | None = None) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=0, desc="loading", unit="step", file=file or sys.stderr,
                        disable=disable, dynamic_ncols=True, leave=True)
        self.done: dict[str, int] = {}
        # Seconds per phase, from each phase's last event (a phase run twice adds up).
        self.seconds: dict[str, float] = {}

    def __call__(self, event: LoadEvent) -> None:
        if event.phase not in self.done or (event.done == 0 and not event.finished):
            self.done[event.phase] = 0
            self.bar.total += event.total
        self.bar.set_description(f"loading: {event.phase}", refresh=False)
        step = event.done - self.done[event.phase]
        self.done[event.phase] = event.done
        if event.finished:
            self.seconds[event.phase] = self.seconds.get(event.phase, 0.0) + event.elapsed_s
        if step:
            self.bar.update(step)
        else:
            self.bar.refresh()

    def summary(self) -> str:
        """``"config 0.1 s, weights 2.3 s, ..."``: the phases seen, in order."""
        return ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in self.seconds.items())

    def close(self, *, failed: bool = False) -> None:
        """Close the bar; its last description says what each phase took (unless the load
        ``failed``: then it stays at the phase that failed)."""
        if not failed:
            self.bar.set_description(f"loaded ({self.summary()})", refresh=False)
        self.bar.close()

    def __enter__(self) -> LoadProgressBar:
        return self

    def __exit__(self, exc_type, *exc_info) -> None:
        self.close(failed=exc_type is not None)


THREADS_HELP = ("torch's CPU threads: an int, or auto (default): one per CPU, half as many "
                "when the 1-minute load average says every CPU is already busy (torch's "
                "threads then wait on each other); not set on CUDA")


def add_threads_argument(parser) -> None:
    """``--threads`` (see :func:`cpu_threads`) on an argparse parser or group."""
    parser.add_argument("--threads", default="auto", help=THREADS_HELP)


def cpu_threads(requested: str, device: str | None) -> int | None:
    """The intra-op thread count for ``--threads requested`` ("auto" or an int >= 1) on
    ``device``, or None to leave torch's default (a CUDA device: the host threads only
    launch kernels).

    auto: torch's default (one per core, at most the CPUs this process may run on), or half
    the CPUs (at least 1) when the 1-minute load average is within half a CPU of their count.

    Raises:
        ValueError: ``requested`` is neither "auto" nor an int >= 1.
    """
    if requested != "auto":
        try:
            value = int(requested)
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(f"--threads: expected 'auto' or an int >= 1, got {requested!r}")
        return value
    import torch

    on_cuda = device.startswith("cuda") if device else torch.cuda.is_available()
    if on_cuda:
        return None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return auto_threads(cpus or 1, load, torch.get_num_threads())


def auto_threads(cpus: int, load: float, default: int) -> int:
    """``--threads auto`` on ``cpus`` CPUs at 1-minute load average ``load``, where torch
    would start ``default`` threads (see :func:`cpu_threads`)."""
    threads = min(default, cpus)
    if load >= cpus - 0.5:
        threads = min(threads, cpus // 2)
    return max(1, threads)


def apply_cpu_threads(requested: str, device: str | None) -> int:
    """Set torch's intra-op threads as :func:`cpu_threads` says; returns the count in use."""
    import torch

    threads = cpu_threads(requested, device)
    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


__all__ = ["LoadProgressBar", "add_threads_argument", "apply_cpu_threads", "auto_threads",
           "cpu_threads"]
