"""rocm-smi: the text report ('GPU[0] : Key: value' lines) and --json ({"card0": {...}}).

Its 'Driver version' is the amdgpu kernel driver, not ROCm, so it is never read as one."""

from __future__ import annotations

import json
import re
from typing import Any

from unsloth.platform.facts import Gpu
from unsloth.platform.parsers import Findings, bus_id, pci_id, to_int

_LINE = re.compile(r"^\s*GPU\[(\d+)\]\s*:\s*(.+?)\s*:\s*(.*?)\s*$")


def parse(text: str) -> Findings:
    cards = _json_cards(text) or _text_cards(text)
    found = Findings()
    if cards:
        found.facts["os"] = "linux"  # rocm-smi ships only with Linux ROCm
    for index, values in sorted(cards.items()):
        found.gpus.append(_gpu(index, values))
    return found


def _json_cards(text: str) -> dict[int, dict[str, str]]:
    start = text.find("{")
    if start < 0:
        return {}
    try:
        data: Any = json.loads(text[start:])
    except ValueError:
        return {}
    cards: dict[int, dict[str, str]] = {}
    if isinstance(data, dict):
        for key, values in data.items():
            match = re.fullmatch(r"card(\d+)", str(key))
            if match and isinstance(values, dict):
                cards[int(match.group(1))] = {str(k).lower(): str(v) for k, v in values.items()}
    return cards


def _text_cards(text: str) -> dict[int, dict[str, str]]:
    cards: dict[int, dict[str, str]] = {}
    for line in text.splitlines():
        if match := _LINE.match(line):
            cards.setdefault(int(match.group(1)), {}).setdefault(match.group(2).lower(), match.group(3))
    return cards


def _gpu(index: int, values: dict[str, str]) -> Gpu:
    def first(*keys: str) -> str | None:
        return next((values[k] for k in keys if values.get(k) not in (None, "", "N/A")), None)

    name = first("card series", "card model", "marketing name")
    gpu = Gpu(vendor="amd", index=index, name=name if name and not name.startswith("0x") else None)
    if (arch := first("gfx version")) and re.fullmatch(r"gfx[0-9a-f]{3,4}", arch):
        gpu.arch = arch
    gpu.pci_id = pci_id(0x1002, to_int(first("device id", "gpu id", "card model")))
    gpu.bus_id = bus_id(first("pci bus"))
    if (total := to_int(first("vram total memory (b)"))) is not None and total > 0:
        gpu.vram_bytes = total
    return gpu
