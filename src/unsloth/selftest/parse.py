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


# What an install's receipt records of torch (its "verified" key, docs/environment.md).
VERIFIED_TORCH = ("version", "cuda", "hip", "gpu_seen", "device_name")


def verification(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """An install's verification run (``--only torch --imports ...``) as the install reads it:
    ``{"torch": {version, cuda, hip, gpu_seen, device_name} or {"error"}, "imports", "packages"}``."""
    torch = results.get("torch")
    if torch is None:
        torch_info: dict[str, Any] = {"error": "the self-test printed no torch result"}
    elif not torch["ok"]:
        torch_info = {"error": torch["message"]}
    else:
        torch_info = {key: torch.get(key) for key in VERIFIED_TORCH}
    return {
        "torch": torch_info,
        "imports": (results.get("imports") or {}).get("modules", {}),
        "packages": (results.get("packages") or {}).get("versions", {}),
    }
