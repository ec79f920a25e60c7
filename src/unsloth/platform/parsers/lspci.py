"""lspci: -nn, -nnk, -vvv, -D, -mm; names resolved from pci.ids or not ('Device 7550'); lines
pasted without their bus address. Without -nn the ids are missing, except that an unresolved
name prints the device id ('NVIDIA Corporation Device 2684').

Display controllers (class 03xx) are GPUs, and so are AMD and NVIDIA "processing accelerators"
(12xx: Instinct MI300-class cards list there); the HDMI audio function of a card (0403) is not, nor
is an NPU (1180)."""

from __future__ import annotations

import re

from unsloth.platform.facts import Gpu
from unsloth.platform.parsers import VENDOR_IDS, Findings, bus_id, pci_id, vendor_from_name

_LINE = re.compile(
    r"^\s*(?:(?P<bus>(?:[0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])\s+)?"
    r"(?P<cls>VGA compatible controller|3D controller|Display controller|Processing accelerators)"
    r"(?:\s*\[(?:03|12)[0-9a-fA-F]{2}\])?:\s*"
    r"(?P<desc>.*?)\s*(?:\[(?P<ven>[0-9a-fA-F]{4}):(?P<dev>[0-9a-fA-F]{4})\])?"
    r"\s*(?:\(rev [0-9a-fA-F]+\))?\s*(?:\(prog-if [^)]*\))?\s*$"
)
# -mm: '01:00.0 "VGA compatible controller [0300]" "NVIDIA Corporation [10de]" "AD102 [GeForce RTX 4090] [2684]" ...'
_MACHINE = re.compile(
    r'^\s*(?P<bus>(?:[0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])\s+'
    r'"(?P<cls>VGA compatible controller|3D controller|Display controller|Processing accelerators)[^"]*"\s+'
    r'"(?P<vendor>[^"]*?)(?:\s*\[(?P<ven>[0-9a-fA-F]{4})\])?"\s+"(?P<desc>[^"]*?)(?:\s*\[(?P<dev>[0-9a-fA-F]{4})\])?"'
)
_UNRESOLVED = re.compile(r"Device ([0-9a-fA-F]{4})")
_VENDOR_PREFIX = re.compile(
    r"^(Advanced Micro Devices, Inc\.\s*\[AMD(?:/ATI)?\]|ATI Technologies Inc|NVIDIA Corporation|"
    r"Intel Corporation)\s*"
)


def parse(text: str) -> Findings:
    found = Findings()
    for line in text.splitlines():
        match = _LINE.match(line) or _MACHINE.match(line)
        if not match:
            continue
        found.facts["os"] = "linux"
        description = match.group("desc")
        if match.re is _MACHINE:
            description = f"{match.group('vendor')} {description}"
        vendor_id = int(match.group("ven"), 16) if match.group("ven") else None
        vendor = VENDOR_IDS.get(vendor_id) if vendor_id is not None else vendor_from_name(description)
        if vendor is None:
            continue  # a virtual or server display chip (ASPEED, Matrox, QXL): not a compute GPU
        if match.group("cls") == "Processing accelerators" and vendor not in ("amd", "nvidia"):
            continue  # Gaudi, FPGAs and such are not GPUs
        device_id = int(match.group("dev"), 16) if match.group("dev") else None
        if vendor_id is None and (unresolved := _UNRESOLVED.fullmatch(_VENDOR_PREFIX.sub("", description).strip())):
            device_id = int(unresolved.group(1), 16)  # no -nn: only an unresolved name shows the id
            vendor_id = {v: k for k, v in VENDOR_IDS.items() if k != 0x1022}[vendor]
        chip, name = _names(description)
        found.gpus.append(
            Gpu(
                vendor=vendor,
                name=name,
                chip=chip,
                index=len(found.gpus),
                pci_id=pci_id(vendor_id, device_id),
                bus_id=bus_id(match.group("bus")),
            )
        )
    return found


def _names(description: str) -> tuple[str | None, str | None]:
    """'Advanced Micro Devices, Inc. [AMD/ATI] Navi 31 [Radeon RX 7900 XT/7900 XTX]'
    -> ('Navi 31', 'Radeon RX 7900 XT/7900 XTX'); 'Device 7550' (unresolved) -> (None, None)."""
    device = _VENDOR_PREFIX.sub("", description).strip()
    if not device or re.fullmatch(r"Device(?: [0-9a-fA-F]{4})?", device):
        return None, None
    bracket = re.match(r"(.*?)\s*\[([^\[\]]+)\]\s*$", device)
    if bracket:
        return bracket.group(1) or None, bracket.group(2)
    return device, device
