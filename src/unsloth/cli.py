"""Command line: arguments -> commands. No decisions live here.

Each command lives in its own module under ``unsloth.commands`` and exposes
``register(subparsers)``, which adds its parser and sets ``func``: args -> a result
(``unsloth.commands.results``), which ``unsloth.commands.render.show`` prints and turns into the exit code.
Modules are imported only when listed here, so ``unsloth detect`` never imports torch.

Errors meet the user here and only here: an ``UnslothError`` becomes its message on stderr (or one
JSON object on stdout with --json) and its exit code; anything else is a bug, said in one line, its
traceback shown with --verbose or UNSLOTH_DEBUG=1. The exit codes are ``unsloth.errors.ExitCode``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import traceback

from unsloth import __version__
from unsloth.commands.render import show
from unsloth.errors import ExitCode, UnslothError
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
    for command in subparsers.choices.values():
        _add_common_flags(command)
    return parser


def _add_common_flags(parser: argparse.ArgumentParser) -> None:
    """--verbose on every command (and each `env` action), and the name errors are reported under."""
    parser.set_defaults(prog=parser.prog)
    nested = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    for action in nested:
        for sub in action.choices.values():
            _add_common_flags(sub)
    if not nested and "--verbose" not in parser._option_string_actions:
        parser.add_argument("--verbose", action="store_true",
                            help="show more; on an unexpected error, its traceback (for a bug report)")


def debugging(args: argparse.Namespace | None = None) -> bool:
    return bool(getattr(args, "verbose", False)) or os.environ.get("UNSLOTH_DEBUG", "").strip().lower() in {
        "1", "true", "yes", "on"}


def report_error(args: argparse.Namespace, exc: UnslothError) -> int:
    """The one place an error is shown: a message on stderr; with --json, also one JSON object on stdout."""
    if getattr(args, "json", False):
        print(json.dumps(exc.to_json(), ensure_ascii=False))
    print(f"{getattr(args, 'prog', 'unsloth')}: {exc}", file=sys.stderr)
    if debugging(args) and exc.__cause__ is not None:
        traceback.print_exception(exc.__cause__, file=sys.stderr)
    return int(exc.exit_code)


def report_bug(args: argparse.Namespace, exc: BaseException) -> int:
    prog = getattr(args, "prog", "unsloth")
    if debugging(args):
        traceback.print_exception(exc, file=sys.stderr)
        how = "attach the traceback above to a bug report"
    else:
        how = "run it again with --verbose (or UNSLOTH_DEBUG=1) and attach the traceback to a bug report"
    problem = f"unexpected error ({type(exc).__name__}: {exc}); this is a bug in unsloth"
    if getattr(args, "json", False):
        print(json.dumps({"ok": False, "error": problem, "kept": None, "fix": how, "exit_code": int(ExitCode.BUG)}))
    print(f"{prog}: {problem}\n  fix: {how}", file=sys.stderr)
    return int(ExitCode.BUG)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return ExitCode.OK
    try:
        with signals_as_interrupt():  # a `kill` cleans up like Ctrl-C: no partial file is left behind
            return show(args.func(args), as_json=bool(getattr(args, "json", False)))
    except UnslothError as exc:
        return report_error(args, exc)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return ExitCode.INTERRUPTED
    except BrokenPipeError:
        # `unsloth detect --json | head`: the reader left; say nothing more. Point stdout at devnull
        # so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return ExitCode.BROKEN_PIPE
    except Exception as exc:  # noqa: BLE001 - a bug: one line, the traceback on request
        return report_bug(args, exc)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
