"""Exit codes and summaries follow from the findings (the type lives in unsloth.selftest.findings)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from unsloth.selftest.findings import STATUSES, Finding

EXIT_OK = 0  # every required check passed (warnings allowed)
EXIT_FAILED = 1  # a required check failed
EXIT_USAGE = 2  # bad arguments or an unreadable dump: nothing was checked


def exit_code(findings: Iterable[Finding]) -> int:
    return EXIT_FAILED if any(f.fails for f in findings) else EXIT_OK


def summarize(findings: list[Finding]) -> dict[str, Any]:
    counts = {status: sum(f.status == status for f in findings) for status in STATUSES}
    return {
        **counts,
        "failed_required": [f.id for f in findings if f.fails],
        "exit_code": exit_code(findings),
    }
