"""hipconfig --version: '6.0.32830-d62f6a171'. HIP's third field is a build number, so only
MAJOR.MINOR names the ROCm release. On its own it is Linux evidence (ROCm's hipconfig); the
Windows HIP SDK's prints Windows paths."""

from __future__ import annotations

import re

from unsloth.platform.parsers import Findings


def parse(text: str) -> Findings:
    found = Findings()
    match = re.search(r"^\s*(?:HIP version\s*:\s*)?(\d+)\.(\d+)\.\d+", text, re.M)
    if match and 1 <= int(match.group(1)) < 100:
        found.facts["rocm_version"] = f"{match.group(1)}.{match.group(2)}"
    if re.search(r"[A-Za-z]:\\|\\Program Files|\.exe\b", text):
        found.facts["os"] = "windows"  # the HIP SDK for Windows
    elif "/opt/rocm" in text or "rocm_version" in found.facts:
        found.facts["os"] = "linux"  # hipconfig comes with Linux ROCm, unless a Windows path says otherwise
    return found
