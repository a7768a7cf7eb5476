"""The command line every benchmark tool shares: ``--out``, ``--replot`` and ``--log-level``.

Light on purpose (no torch, no triton), so ``--help`` and ``--replot`` stay fast and need no
GPU:

- :func:`add_output_arguments`: ``--out`` (with the tool's own help) and ``--replot JSON``.
- :func:`add_log_level` and :func:`parse_and_log`: ``--log-level``, then parse and set up
  logging in the tools' one format.
- :func:`replot_if_asked`: redraw a saved results file's plot beside it.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def add_output_arguments(parser: argparse.ArgumentParser, out_help: str) -> None:
    """``--out`` (default None; ``out_help`` says what the tool writes there) and ``--replot``."""
    parser.add_argument("--out", default=None, help=out_help)
    parser.add_argument("--replot", metavar="JSON",
                        help="draw a results JSON's plot beside it (no GPU needed), then exit")


def add_log_level(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="INFO", type=str.upper,
                        help="logging level: DEBUG, INFO, WARNING, ERROR (default INFO)")


def parse_and_log(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv`` (None: ``sys.argv``) and set up logging at its ``--log-level``."""
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    return args


def replot_if_asked(args: argparse.Namespace, plot: Callable[[Path, Any], None],
                    select: Callable[[dict], Any] = lambda results: results) -> bool:
    """With ``--replot JSON``: draw ``plot(JSON with a .png suffix, select(results))`` and
    return True (the tool then exits); without it, return False."""
    if not args.replot:
        return False
    source = Path(args.replot)
    plot(source.with_suffix(".png"), select(json.loads(source.read_text())))
    return True
