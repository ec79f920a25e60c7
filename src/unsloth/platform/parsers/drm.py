"""DRM sysfs: /sys/class/drm/card*/device files, 'name: value' lines, one block per card (the
probe writes a '== <path> ==' header and the card's PCI address)."""

from __future__ import annotations

import re

from unsloth.platform.facts import Gpu
from unsloth.platform.parsers import VENDOR_IDS, Findings, blocks, bus_id, key_values, pci_id, to_int

_HEADER = re.compile(r"^\s*==.*==\s*$")


def parse(text: str) -> Findings:
    found = Findings()
    for card in blocks(text, _HEADER):
        values = key_values(card)
        vendor, device = to_int(values.get("vendor")), to_int(values.get("device"))
        if vendor not in VENDOR_IDS or (values.get("class") and not values["class"].startswith("0x03")):
            continue
        found.facts["os"] = "linux"
        gpu = Gpu(
            vendor=VENDOR_IDS[vendor],
            pci_id=pci_id(vendor, device),
            index=len(found.gpus),
            bus_id=bus_id(values.get("pci_address") or card.splitlines()[0]),
        )
        if (vram := to_int(values.get("mem_info_vram_total"))) is not None and vram > 0:
            gpu.vram_bytes = vram
        found.gpus.append(gpu)
    return found
