"""The install receipt: what an environment was built from and what it holds (docs/environment.md).

Written last and atomically, so an environment with a receipt is a finished, verified one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping

from unsloth.envs.fsio import write_json_atomic
from unsloth.envs.paths import RECEIPT_NAME

SCHEMA = 1


@dataclass
class Receipt:
    """What one environment was built from and holds; its JSON is receipt.json (docs/environment.md).
    The nested values are other parts' JSON as they wrote it (the request, the platform, the plan)."""

    name: str
    created: str | None = None  # UTC, ISO 8601
    finished: str | None = None
    unsloth: dict[str, Any] = field(default_factory=dict)  # {"version", "source"}
    request: dict[str, Any] = field(default_factory=dict)
    request_hash: str | None = None
    fingerprint: str | None = None  # hardware_fingerprint of the platform it was built on
    platform: dict[str, Any] = field(default_factory=dict)
    plan: dict[str, Any] = field(default_factory=dict)
    python: dict[str, Any] = field(default_factory=dict)  # {"version", "executable"}
    installer: dict[str, Any] = field(default_factory=dict)  # {"tool", "version"}
    indexes: dict[str, Any] = field(default_factory=dict)
    without: list[str] = field(default_factory=list)
    optional_failed: dict[str, str] = field(default_factory=dict)  # part -> its log
    packages: dict[str, str] = field(default_factory=dict)  # distribution -> version
    verified: dict[str, Any] = field(default_factory=dict)  # what the self-test saw

    @property
    def backend(self) -> str | None:
        """The torch backend of the plan it was built from."""
        return (self.plan.get("torch") or {}).get("backend")

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "schema": SCHEMA}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Receipt | None:
        """None when it is not one: another schema, or no name."""
        if data.get("schema") != SCHEMA or not isinstance(data.get("name"), str):
            return None
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in known})


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


def read_receipt(env: Path) -> Receipt | None:
    """The receipt of ``env``, or None when the env is unfinished, or the receipt unreadable or from a newer schema."""
    try:
        data = json.loads((env / RECEIPT_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    try:
        return Receipt.from_json(data)
    except TypeError:  # a field of the wrong shape
        return None


def write_receipt(env: Path, receipt: Receipt) -> None:
    write_json_atomic(env / RECEIPT_NAME, receipt.to_json())
