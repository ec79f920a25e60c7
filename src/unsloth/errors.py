"""The one error type users see: what was wrong, what was kept safe, and the command or setting
that fixes it; and the exit codes every command shares (docs/cli.md lists them).

Every layer raises a subclass (config, matrix, export, build, ...); ``unsloth.cli.main`` maps them to
a message (or JSON) and an exit code in one place.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any


class ExitCode(IntEnum):
    OK = 0  # done; for doctor: every required check passed (warnings allowed)
    FAILED = 1  # the work ran and did not succeed (a required check, a build, an export); nothing was lost
    USAGE = 2  # bad arguments, config, dataset, model or file: refused before any work started
    OUT_OF_MEMORY = 3  # training ran out of GPU memory; checkpoints so far are kept
    BUG = 70  # an unexpected error inside unsloth (a bug): --verbose or UNSLOTH_DEBUG=1 shows its traceback
    INTERRUPTED = 130  # Ctrl-C (SIGINT) or SIGTERM
    BROKEN_PIPE = 141  # the reader of stdout went away (`unsloth detect --json | head`)


class UnslothError(Exception):
    """``problem``: what was wrong; ``fix``: the command or setting that fixes it; ``kept``: what was
    kept safe ("nothing was written"), when the user would otherwise wonder."""

    exit_code: ExitCode = ExitCode.FAILED

    def __init__(self, problem: str, fix: str | None = None, *, kept: str | None = None,
                 exit_code: ExitCode | None = None):
        super().__init__(problem)
        self.problem = problem
        self.fix = fix
        self.kept = kept
        if exit_code is not None:
            self.exit_code = exit_code

    def __str__(self) -> str:
        line = self.problem if not self.kept else f"{self.problem}; {self.kept}"
        return line if not self.fix else f"{line}\n  fix: {self.fix}"

    def to_json(self) -> dict[str, Any]:
        return {"ok": False, "error": self.problem, "kept": self.kept, "fix": self.fix,
                "exit_code": int(self.exit_code)}


class UsageError(UnslothError):
    """Bad input caught before any work started (arguments, files, values)."""

    exit_code = ExitCode.USAGE
