"""macOS `system_profiler SPDisplaysDataType`: one block per 'Chipset Model:'."""

from __future__ import annotations

import re

from unsloth.platform.facts import Gpu
from unsloth.platform.parsers import VENDOR_IDS, Findings, blocks, key_values, pci_id, to_int, vendor_from_name

_BLOCK = re.compile(r"^\s*Chipset Model:")
_UNITS = {"MB": 2**20, "GB": 2**30}


def parse(text: str) -> Findings:
    found = Findings()
    for block in blocks(text, _BLOCK):
        values = key_values(block)
        name = values.get("chipset model") or None
        vendor_id = to_int((re.search(r"\((0x[0-9a-fA-F]{4})\)", values.get("vendor", "")) or [None, None])[1])
        vendor = VENDOR_IDS.get(vendor_id) if vendor_id else vendor_from_name(f"{values.get('vendor', '')} {name}")
        if vendor is None:
            continue
        found.facts.update(os="macos", wsl=False)
        gpu = Gpu(vendor=vendor, name=name, index=len(found.gpus))
        gpu.pci_id = pci_id(vendor_id, to_int(values.get("device id"))) if vendor != "apple" else None
        bus = values.get("bus", "")
        if bus:
            gpu.integrated = bus.lower() == "built-in"
        vram = re.match(r"(\d+)\s*(MB|GB)", values.get("vram (total)", "") or values.get("vram", ""))
        if vram and not gpu.integrated:
            gpu.vram_bytes = int(vram.group(1)) * _UNITS[vram.group(2)]
        found.gpus.append(gpu)
    return found
