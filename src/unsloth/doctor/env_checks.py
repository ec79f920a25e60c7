"""The managed-environment check: is the environment there, readable, and built for this machine?

What its own Python then says about torch, the GPU, bitsandbytes, Triton and llama.cpp is the
self-test's (unsloth.selftest).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from unsloth.doctor.findings import Finding
from unsloth.envs.receipt import Receipt, hardware_fingerprint
from unsloth.platform.facts import Platform
from unsloth.selftest.judge import REINSTALL


@dataclass
class EnvTarget:
    """The interpreter the environment checks run in, and what is known about it."""

    python: Path
    origin: str  # "managed" (the active environment) | "--python"
    env: Path | None = None
    receipt: Receipt | None = None


def check_env(target: EnvTarget | None, platform: Platform | None) -> Finding:
    """The managed environment exists, its receipt reads, its Python is there, and it was built for this machine."""
    title = "Managed environment"
    if target is None:
        return Finding("env", title, "warning", "No managed environment yet", fix="unsloth install")
    if target.origin == "--python":
        if not target.python.is_file():
            return Finding("env", title, "error", f"{target.python} (given with --python) does not exist",
                           fix="Give the path of a Python interpreter, e.g. --python .venv/bin/python", required=True)
        return Finding("env", title, "ok", f"Checking {target.python} (given with --python)")
    if target.receipt is None:
        return Finding("env", title, "error", f"{target.env}: its receipt is missing or unreadable",
                       fix=REINSTALL, required=True)
    if not target.python.exists():
        return Finding("env", title, "error", f"{target.env}: its Python ({target.python}) is missing",
                       fix=REINSTALL, required=True)
    name = target.receipt.name or target.env.name
    built = target.receipt.finished or "?"
    if platform is not None and target.receipt.fingerprint not in (None, hardware_fingerprint(platform.to_json())):
        return Finding("env", title, "warning",
                       f"{name} was built for other hardware or drivers than this machine has now",
                       fix=REINSTALL)
    return Finding("env", title, "ok", f"{name} (built {built})", detail=str(target.env))
