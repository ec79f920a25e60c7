"""What each command hands back: typed data, nothing printed. ``unsloth.commands.render`` shows them
(text for people, JSON with --json) and takes the exit code from them; ``unsloth.cli.main`` calls it.
A result's ``notes`` are lines for stderr (what was written or repaired on the way), shown first.

Errors are not results: they are ``UnslothError``s, shown by ``unsloth.cli.report_error``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# install, update, rollback, uninstall (and a declined confirmation): defined beside the manager that
# returns them, since unsloth.envs sits below the commands.
from unsloth.envs.outcomes import (  # noqa: F401 - re-exported
    BuildInterrupted, BuildRefused, Declined, Exposure, Installed, NothingToRollBack, RolledBack, Uninstalled, UpToDate)
from unsloth.errors import ExitCode


@dataclass(frozen=True)
class PlatformReport:
    """`unsloth detect`: the machine's (or a dump's) facts."""

    platform: Any  # unsloth.platform.facts.Platform
    exit_code = ExitCode.OK


@dataclass(frozen=True)
class DoctorReport:
    """`unsloth doctor`: the findings, and how they were asked for."""

    report: Any  # unsloth.doctor.run.Report
    platform: Any
    verbose: bool = False
    from_dir: Path | None = None
    dump: Path | None = None  # where the raw probe outputs were written, if asked

    @property
    def notes(self) -> tuple[str, ...]:
        if self.dump is None:
            return ()
        return (f"Wrote every probe's raw output to {self.dump.resolve()}: attach that folder to your bug report "
                f"(read it back with `unsloth doctor --from {self.dump}`).",)

    @property
    def exit_code(self) -> int:
        return self.report.summary()["exit_code"]


@dataclass(frozen=True)
class EnvListing:
    """`unsloth env list`: one row per managed environment."""

    rows: list[dict[str, Any]]
    home: Path
    exit_code = ExitCode.OK


@dataclass(frozen=True)
class EnvPath:
    """`unsloth env path`: the active environment's folder, or its interpreter."""

    path: Path
    notes: tuple[str, ...] = ()  # what was repaired on the way (lines for stderr)
    exit_code = ExitCode.OK


@dataclass(frozen=True)
class EnvLock:
    """`unsloth env export`: a requirements lock of the active environment."""

    text: str
    env_name: str
    output: Path | None = None  # written there; None: the lock is the output
    notes: tuple[str, ...] = ()

    @property
    def pinned(self) -> int:
        return sum(1 for line in self.text.splitlines() if line and not line.startswith(("#", "--")))

    exit_code = ExitCode.OK


@dataclass(frozen=True)
class NoEnvironment:
    """An `env` action with nothing installed under the install home."""

    home: Path
    notes: tuple[str, ...] = ()
    exit_code = ExitCode.FAILED


@dataclass(frozen=True)
class PlanReport:
    """`unsloth install --dry-run`: the plan, and where the real install would take each part from."""

    plan: Any  # unsloth.plan.Plan
    sources: Any = None  # unsloth.envs.sources.SourcesReport; None: not worked out (never for a live plan)
    exit_code = ExitCode.OK


@dataclass(frozen=True)
class Trained:
    """`unsloth train CONFIG`: where the adapters (and a merged model) went, or the fully fine-tuned model."""

    output_dir: str
    merged_dir: str | None = None
    full_finetuning: bool = False
    exit_code = ExitCode.OK


@dataclass(frozen=True)
class TrainInterrupted:
    """Ctrl-C or SIGTERM during `unsloth train`: the checkpoints so far are kept."""

    output_dir: str
    exit_code = ExitCode.INTERRUPTED


@dataclass(frozen=True)
class DemoRun:
    """`unsloth train --demo`: it printed its own progress; it succeeded when the loss went down."""

    losses: list[float] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return ExitCode.OK if self.losses and self.losses[-1] < self.losses[0] else ExitCode.FAILED


@dataclass(frozen=True)
class Exported:
    """`unsloth export`: the files written (with their sizes) and how each one validated."""

    result: Any  # unsloth.export.gguf.ExportResult
    sizes: dict[str, int] = field(default_factory=dict)  # method -> bytes

    @property
    def ok(self) -> bool:
        return all(v.passed for v in self.result.validations.values())

    exit_code = ExitCode.OK  # a weak quantization is a warning, not a failure


@dataclass(frozen=True)
class Generated:
    """`unsloth generate --json`: the whole reply with its token counts and timing."""

    generation: Any  # unsloth.export.chat.Generation
    exit_code = ExitCode.OK
