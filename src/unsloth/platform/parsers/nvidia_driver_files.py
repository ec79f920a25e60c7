"""/proc/driver/nvidia/version ('NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.14  ...')
and /sys/module/nvidia/version ('550.54.14'): the Linux kernel driver. Neither exists under WSL."""

from __future__ import annotations

import re

from unsloth.platform.parsers import Findings


def parse(text: str) -> Findings:
    found = Findings()
    match = re.search(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+\.\d+(?:\.\d+)?)", text) or re.fullmatch(
        r"\s*(\d{3}\.\d+(?:\.\d+)?)\s*", text
    )
    if match:
        found.facts.update(nvidia_driver=match.group(1), os="linux")
    return found
