"""``mini-paged-attn``: the command line.

Each sub-command lives in ``mini_paged_attn/commands/<name>.py`` with ``add_arguments(parser)``
and ``run(args) -> int``; this file only wires them, importing a command's module (and so its
heavy dependencies) when that command runs.

A user's mistake (a bad option, a model directory that cannot be loaded) prints one
``error: ...`` line and exits 2; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMANDS = {
    "demo": "walk the seeds' story on CPU: block manager, paged KV cache, copy-on-write, paged "
            "attention vs dense, then a tiny engine",
    "generate": "generate text with a local Hugging Face model directory",
    "serve": "serve an OpenAI-compatible HTTP API",
}


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

# What a user's mistake raises: a bad value (ValueError and the project's ModelLoadError, a
# subclass) or a path that is not there. Any other exception is a bug and keeps its traceback.
USER_ERRORS = (ValueError, FileNotFoundError)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mini_paged_attn")
    except PackageNotFoundError:
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mini-paged-attn", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("--log-level", default="WARNING", type=str.upper, choices=LOG_LEVELS,
                        help="logging level for the library: " + ", ".join(LOG_LEVELS)
                             + " (default WARNING)")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an error instead of one line")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        module = importlib.import_module(f"mini_paged_attn.commands.{name}")
        module.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    module = importlib.import_module(f"mini_paged_attn.commands.{args.command}")
    try:
        return int(module.run(args) or 0)
    except USER_ERRORS as exc:
        if args.debug:
            raise
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
