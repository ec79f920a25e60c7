"""Exit codes and summaries follow from the findings (the type lives in unsloth.selftest.findings)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from unsloth.errors import ExitCode
from unsloth.selftest.findings import STATUSES, Finding


def exit_code(findings: Iterable[Finding]) -> ExitCode:
    """FAILED when a required check failed, else OK (warnings allowed)."""
    return ExitCode.FAILED if any(f.fails for f in findings) else ExitCode.OK


def summarize(findings: list[Finding]) -> dict[str, Any]:
    counts = {status: sum(f.status == status for f in findings) for status in STATUSES}
    return {
        **counts,
        "failed_required": [f.id for f in findings if f.fails],
        "exit_code": int(exit_code(findings)),
    }
