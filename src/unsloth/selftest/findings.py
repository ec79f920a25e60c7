"""A finding: one check's verdict in one line, with the exact fix."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

STATUSES = ("ok", "warning", "error", "skipped")


@dataclass(frozen=True)
class Finding:
    id: str  # stable, kebab-case: "gpu", "driver", "env-torch"
    title: str  # what was checked: "GPU driver"
    status: str  # one of STATUSES; "skipped" says the check applies but could not run here
    message: str  # one line: what was found
    fix: str | None = None  # the exact command or step; None when there is nothing to do
    required: bool = False  # only a failed required check makes the exit status non-zero
    detail: str = ""  # evidence for --verbose: probe output, versions, a traceback

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"finding {self.id!r}: status {self.status!r} is not one of {STATUSES}")

    @property
    def fails(self) -> bool:
        return self.required and self.status == "error"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
