"""/opt/rocm/.info/version: '6.4.0-47' -> '6.4.0'."""

from __future__ import annotations

import re

from unsloth.platform.parsers import Findings


def parse(text: str) -> Findings:
    found = Findings()
    if match := re.match(r"\s*(\d+\.\d+(?:\.\d+)?)", text):
        found.facts.update(rocm_version=match.group(1), os="linux")
    return found
