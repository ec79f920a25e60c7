"""The install receipt: what an environment was built from and what it holds (docs/environment.md).

Written last and atomically, so an environment with a receipt is a finished, verified one.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from unsloth.envs.fsio import write_json_atomic
from unsloth.envs.paths import RECEIPT_NAME

SCHEMA = 1


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def digest(data: Any) -> str:
    """A stable hash of JSON-able data (key order does not matter)."""
    blob = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def hardware_fingerprint(platform: dict[str, Any]) -> str:
    """What about the machine decides the plan: OS, CPU architecture, drivers and each GPU's identity."""
    gpus = [
        {key: gpu.get(key) for key in ("vendor", "arch", "pci_id", "compute_capability", "vram_bytes")}
        for gpu in platform.get("gpus") or []
    ]
    facts = {key: platform.get(key) for key in ("os", "wsl", "machine", "nvidia_driver", "cuda_driver", "rocm_version")}
    return digest({"facts": facts, "gpus": gpus})


def read_receipt(env: Path) -> dict[str, Any] | None:
    """The receipt of ``env``, or None when the env is unfinished, or the receipt unreadable or from a newer schema."""
    try:
        data = json.loads((env / RECEIPT_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        return None
    return data


def write_receipt(env: Path, receipt: dict[str, Any]) -> None:
    write_json_atomic(env / RECEIPT_NAME, {**receipt, "schema": SCHEMA})
