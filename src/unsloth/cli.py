"""Command line: arguments -> commands. No decisions live here.

Each command lives in its own module under ``unsloth.commands`` and exposes
``register(subparsers)``, which adds its parser and sets ``func`` (args -> exit code).
Modules are imported only when listed here, so ``unsloth detect`` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from unsloth import __version__
from unsloth.interrupts import signals_as_interrupt

# Order is the order of `unsloth --help`.
COMMAND_MODULES = (
    "unsloth.commands.detect",
    "unsloth.commands.install",
    "unsloth.commands.doctor",
    "unsloth.commands.envs",
    "unsloth.commands.train",
    "unsloth.commands.export",
    "unsloth.commands.chat",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="unsloth",
        description="Detect your GPU, install the right stack, check it, fine-tune, export.",
    )
    parser.add_argument("--version", action="version", version=f"unsloth {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # a real missing dependency inside the module: say so
                raise
            continue
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        with signals_as_interrupt():  # a `kill` cleans up like Ctrl-C: no partial file is left behind
            return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `unsloth detect --json | head`: the reader left; say nothing more. Point stdout at devnull
        # so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
