"""amd-smi: `static`, `list` and `version` outputs (text form; --json also accepted).

`version` prints 'ROCm version: 6.4.0' next to the amdgpu driver version; only the former is ROCm."""

from __future__ import annotations

import json
import re
from typing import Any

from unsloth.platform.facts import Gpu
from unsloth.platform.parsers import Findings, blocks, bus_id, pci_id, to_int

_GPU_BLOCK = re.compile(r"^\s*GPU:\s*\d+\s*$")
_ROCM = re.compile(r"ROCm version:\s*(\d+\.\d+(?:\.\d+)?)", re.I)


def parse(text: str) -> Findings:
    found = Findings()
    if match := _ROCM.search(text):
        found.facts["rocm_version"] = match.group(1)
    if re.search(r"amdgpu version:\s*\d|KERNEL_VERSION|Kernel version", text):
        found.facts["os"] = "linux"  # the amdgpu kernel driver: Linux
    for index, block in enumerate(_json_blocks(text) or blocks(text, _GPU_BLOCK)):
        found.gpus.append(_gpu(index, block))
    if found.gpus or "rocm_version" in found.facts:
        found.facts["os"] = "linux"  # amd-smi ships with Linux ROCm only
    return found


def _json_blocks(text: str) -> list[str]:
    """Flatten `amd-smi ... --json` GPU objects into 'KEY: value' lines, so one reader serves both."""
    start = text.find("[")
    if start < 0:
        return []
    try:
        data: Any = json.loads(text[start:])
    except ValueError:
        return []
    if isinstance(data, dict):
        data = data.get("gpu_data", [data])
    if not isinstance(data, list):
        return []

    def flatten(value: Any, lines: list[str]) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                if isinstance(inner, (dict, list)):
                    lines.append(f"{key}:")
                    flatten(inner, lines)
                else:
                    lines.append(f"{key}: {inner}")

    out = []
    for item in data:
        if isinstance(item, dict) and "gpu" in item:
            lines: list[str] = []
            flatten(item, lines)
            out.append("\n".join(lines))
    return out


def _gpu(index: int, block: str) -> Gpu:
    def value(key: str) -> str | None:
        match = re.search(rf"^\s*{key}:\s*(.+?)\s*$", block, re.M | re.I)
        return match.group(1) if match and match.group(1) not in ("N/A", "") else None

    gpu = Gpu(vendor="amd", index=index, name=value("MARKET_NAME") or value("market_name"))
    if (arch := value("TARGET_GRAPHICS_VERSION")) and re.fullmatch(r"gfx[0-9a-f]{3,4}", arch):
        gpu.arch = arch
    vendor = to_int(value("VENDOR_ID")) or 0x1002
    gpu.pci_id = pci_id(vendor, to_int(value("DEVICE_ID")))
    gpu.bus_id = bus_id(value("BDF"))
    uuid = value("UUID")
    gpu.uuid = uuid if uuid and re.fullmatch(r"[0-9a-f-]{16,}", uuid, re.I) else None
    size = re.search(r"^\s*VRAM:\s*\n(?:\s+\w+:.*\n)*?\s+SIZE:\s*(\d+)\s*(MB|GB|B)?\s*$", block, re.M | re.I)
    if size:
        gpu.vram_bytes = int(size.group(1)) * {"MB": 2**20, "GB": 2**30}.get((size.group(2) or "B").upper(), 1)
    return gpu
