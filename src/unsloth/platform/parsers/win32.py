"""Windows: Win32_VideoController as wmic, Get-CimInstance or Get-WmiObject prints it (list or table
form), and the display-class registry keys that hold HardwareInformation.qwMemorySize.

AdapterRAM is a uint32: at 4 GiB and above it saturates (4293918720), so such a value means
'unknown' and only qwMemorySize gives the size. DriverVersion is the Adrenalin/GeForce driver,
never a ROCm or CUDA version."""

from __future__ import annotations

import re

from unsloth.platform.facts import Gpu
from unsloth.platform.parsers import VENDOR_IDS, Findings, pci_id, product_vendor, to_int, vendor_from_name

ADAPTER_RAM_SATURATED = 4293918720
_COLUMN = re.compile(r"[A-Z][A-Za-z0-9_]*")
_KNOWN = {"name", "caption", "description", "videoprocessor", "pnpdeviceid", "adapterram", "adaptercompatibility"}


def parse(text: str) -> Findings:
    found = Findings()
    records = _list_records(text) or _table_records(text) or _bare_names(text)
    if records:
        found.facts.update(os="windows", wsl=False)
    for record in records:
        if gpu := _gpu(record):
            gpu.index = len(found.gpus)
            found.gpus.append(gpu)
    return found


def parse_registry(text: str) -> Findings:
    """`reg query ... /s` or PowerShell Get-ItemProperty output -> [(DriverDesc, qwMemorySize)]."""
    found = Findings()
    memory: list[tuple[str | None, int]] = []
    name: str | None = None
    for line in text.splitlines():
        desc = re.match(r"\s*DriverDesc\s+(?:REG_SZ\s+|:\s*)(.+?)\s*$", line)
        if desc:
            name = desc.group(1)
        size = re.match(r"\s*HardwareInformation\.qwMemorySize\s+(?:REG_QWORD\s+|:\s*)(\S+)", line)
        if size and (value := to_int(size.group(1))):
            memory.append((name, value))
            name = None
        if re.match(r"\s*HKEY_LOCAL_MACHINE\\", line):
            name = None
    if memory:
        found.facts.update(os="windows", wsl=False, _registry_memory=memory)
    return found


def _list_records(text: str) -> list[dict[str, str]]:
    """'Name : value' (PowerShell Format-List) or 'Name=value' (wmic /format:list) blocks."""
    records: list[dict[str, str]] = []
    current: dict[str, str] = {}
    for line in text.splitlines() + [""]:
        match = re.match(r"^([A-Za-z][A-Za-z0-9_]*)\s*(?::|=)\s?(.*?)\s*$", line)
        if match and not line.startswith(" "):
            key = match.group(1).lower()
            if key in current:  # a repeated property starts the next adapter
                records.append(current)
                current = {}
            current[key] = match.group(2)
        elif not line.strip() and current:
            records.append(current)
            current = {}
    return [r for r in records if _KNOWN & set(r)]


_PROMPT = re.compile(r"^\s*(PS )?[A-Za-z]:\\[^>]*>")  # 'PS C:\Users\me> ...', 'C:\>'
_BANNER = re.compile(r"(Windows )?PowerShell( \d[\d.]*)?$|Copyright \(C\) Microsoft|Install the latest PowerShell|"
                     r"https://aka\.ms/")  # the lines a new PowerShell window opens with
_SOFTWARE_ADAPTER = re.compile(r"Basic (Display|Render)|Remote Display|Virtual Display|Parsec|DisplayLink|Idd|Hyper-V|"
                               r"VMware|VirtualBox|Citrix|Meta Virtual|Spacedesk|Mirage", re.I)


def _bare_names(text: str) -> list[dict[str, str]]:
    """`(Get-WmiObject Win32_VideoController).Name`: one adapter name a line, between prompts.
    Only when every other line is a prompt or a 'Name' heading, and each name names a GPU vendor
    (product_vendor) or a software adapter: anything else is not this output."""
    names = []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or _PROMPT.match(line) or re.fullmatch(r"Name|-+", stripped) or _BANNER.match(stripped):
            continue
        if not (product_vendor(stripped) or _SOFTWARE_ADAPTER.search(stripped)) or len(stripped) > 80:
            return []
        names.append({"name": stripped})
    return names if any(product_vendor(n["name"]) for n in names) else []


def _table_records(text: str) -> list[dict[str, str]]:
    lines = text.splitlines()
    for number, line in enumerate(lines):
        words = line.split()
        if not words or not all(_COLUMN.fullmatch(w) for w in words) or not _KNOWN & {w.lower() for w in words}:
            continue
        below = lines[number + 1] if number + 1 < len(lines) else ""
        if re.fullmatch(r"[\s-]+", below) and "-" in below:  # Format-Table: dashes mark each column
            starts = [m.start() for m in re.finditer(r"-+", below)]
            body = lines[number + 2 :]
        else:  # wmic: columns start where the header words do
            starts = [m.start() for m in re.finditer(r"\S+", line)]
            body = lines[number + 1 :]
        names = [m.group(0).lower() for m in re.finditer(r"\S+", line)]
        if len(names) != len(starts):
            return []
        records = []
        for row in body:
            if not row.strip():
                continue
            cells = [row[start:end].strip() for start, end in zip(starts, starts[1:] + [len(row)], strict=True)]
            records.append(dict(zip(names, cells, strict=True)))
        return records
    return []


def _gpu(record: dict[str, str]) -> Gpu | None:
    name = record.get("name") or record.get("caption") or record.get("description") or None
    pnp = record.get("pnpdeviceid", "")
    if re.match(r"(ROOT|SWD)\\", pnp, re.I) or (not pnp and _SOFTWARE_ADAPTER.search(name or "")):
        return None  # a software display adapter (Basic Display, remote/virtual displays)
    ids = re.search(r"VEN_([0-9A-Fa-f]{4})&DEV_([0-9A-Fa-f]{4})", pnp)
    vendor_id = int(ids.group(1), 16) if ids else None
    vendor = VENDOR_IDS.get(vendor_id) if vendor_id is not None else None
    vendor = vendor or vendor_from_name(f"{record.get('adaptercompatibility', '')} {name or ''}")
    if vendor is None:
        return None
    gpu = Gpu(vendor=vendor, name=name)
    if ids:
        gpu.pci_id = pci_id(vendor_id, int(ids.group(2), 16))
    elif processor := re.search(r"\(0x([0-9A-Fa-f]{4})\)", record.get("videoprocessor", "")):
        vendor_number = {v: k for k, v in VENDOR_IDS.items() if k != 0x1022}[vendor]
        gpu.pci_id = pci_id(vendor_number, int(processor.group(1), 16))
    ram = to_int(record.get("adapterram"))
    if ram and ram < ADAPTER_RAM_SATURATED:
        gpu.vram_bytes = ram
    return gpu
