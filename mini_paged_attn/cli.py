"""``mini-paged-attn``: the command line.

Each sub-command lives in ``mini_paged_attn/commands/<name>.py`` with ``add_arguments(parser)``
and ``run(args) -> int``; this file only wires them, importing a command's module (and so its
heavy dependencies) when that command runs.
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mini-paged-attn", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="WARNING",
                        help="logging level for the library (DEBUG, INFO, WARNING, ...)")
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
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
