"""The self-test script's output, read: one JSON object per line, keyed by its check. Pure."""

from __future__ import annotations

import json
from typing import Any


def parse_probe_output(stdout: str) -> dict[str, dict[str, Any]]:
    results = {}
    for line in stdout.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a package printed to stdout; the checks' lines are whole JSON objects
        if isinstance(record, dict) and "check" in record:
            results[record["check"]] = record
    return results
