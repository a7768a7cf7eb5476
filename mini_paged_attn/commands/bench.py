"""``mini-paged-attn bench``: the engine benchmark of ``benchmarks/bench_engine.py`` (GPU).

The benchmark lives with the others in the repository's ``benchmarks/`` folder; this command
runs it from a checkout (an editable install), with the same options.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_engine.py"


def _load():
    if not _SCRIPT.is_file():
        raise SystemExit(f"bench: {_SCRIPT} not found; run from a checkout of the repository "
                         "(pip install -e .)")
    spec = importlib.util.spec_from_file_location("bench_engine", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def add_arguments(parser: argparse.ArgumentParser) -> None:
    if _SCRIPT.is_file():
        _load().add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    return _load().run(args)
