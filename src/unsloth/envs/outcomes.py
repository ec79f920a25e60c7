"""What `install`, `update`, `rollback` and `uninstall` hand back: typed data, nothing printed.

``unsloth.commands.results`` re-exports them beside the other commands' results, and
``unsloth.commands.render`` prints them (``envs`` sits below ``commands``, so they are defined here).
What a long job says while it works (its steps, a wait for the lock) goes to the progress console it
is handed; what it ended with is one of these.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from unsloth.errors import ExitCode


@dataclass(frozen=True)
class Exposure:
    """The launcher and the PATH line after an install: where each went, and whether PATH has it now."""

    launcher: Path
    bin_dir: Path
    path_added_to: tuple[Path, ...] = ()  # shell start-up files that got the PATH line just now
    on_path: bool = True
    windows: bool = False


@dataclass(frozen=True)
class Installed:
    """A new environment was built, verified and switched to."""

    env: str
    backend: str
    exposure: Exposure
    previous: str | None = None  # the one `unsloth rollback` returns to
    exit_code = ExitCode.OK


@dataclass(frozen=True)
class UpToDate:
    """Nothing was built: the active environment already matches the plan (``newest``: and `update`
    found nothing newer)."""

    env: str
    backend: str
    exposure: Exposure
    newest: bool = False
    exit_code = ExitCode.OK


@dataclass(frozen=True)
class Declined:
    """The user answered no to a confirmation: nothing was changed."""

    exit_code = ExitCode.FAILED


@dataclass(frozen=True)
class BuildRefused:
    """A build step failed or the new environment did not verify; that build was removed."""

    problem: str  # "<step> failed", or what the verification found wrong
    fix: str
    log: Path | None
    kept: str | None  # the environment still active, or None: nothing was installed
    tail: str | None = None  # the failed step's last output lines
    found: tuple[str, ...] = ()  # each problem the verification found
    exit_code = ExitCode.FAILED


@dataclass(frozen=True)
class BuildInterrupted:
    """Ctrl-C or SIGTERM during a build: the half-built environment was removed."""

    kept: str | None
    exit_code = ExitCode.INTERRUPTED


@dataclass(frozen=True)
class RolledBack:
    active: str  # active again
    was: str  # `unsloth rollback` swaps back to it
    exit_code = ExitCode.OK


@dataclass(frozen=True)
class NothingToRollBack:
    exit_code = ExitCode.FAILED


@dataclass(frozen=True)
class Uninstalled:
    """What was removed, which start-up files lost the PATH line, and the caches left (what, folder, bytes)."""

    removed: tuple[Path, ...]
    path_removed_from: tuple[Path, ...] = ()
    caches_kept: tuple[tuple[str, Path, int], ...] = ()
    exit_code = ExitCode.OK
