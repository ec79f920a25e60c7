"""rocm-smi in each form it prints: the text report ('GPU[0] : Key: value' lines), --json
({"card0": {...}}), --csv (a header row of column names under 'device', one 'cardN' row per GPU),
--showhw and the concise tables of ROCm 5.x/6.x (one row per GPU under a header line).

Its 'Driver version' is the amdgpu kernel driver, not ROCm, so it is never read as one. In the
concise table of ROCm 5.x/6.0, '[Model : Revision]' is the subsystem id, not the PCI device id,
and the product name wraps onto the next line, cut at 20 characters."""

from __future__ import annotations

import json
import re
from typing import Any

from unsloth.platform.facts import Gpu
from unsloth.platform.parsers import Findings, bus_id, gfx_target, pci_id, to_int

_LINE = re.compile(r"^\s*GPU\[(\d+)\]\s*:\s*(.+?)\s*:\s*(.*?)\s*$")
_CSV_ROW = re.compile(r"^\s*card(\d+)\s*,")
_TABLE_HEADER = re.compile(r"^\s*(GPU|Device)(\s|\[Model)(?=.*\b(DID|Temp|SCLK|GFX VER|VBIOS)\b)")
_TABLE_ROW = re.compile(r"^\s*(\d+)\s+(\S.*)$")
_NAME_WIDTH = 20  # the concise table's "Name (20 chars)" line


def parse(text: str) -> Findings:
    cards = _json_cards(text) or _text_cards(text)
    for index, values in {**_csv_cards(text), **_table_cards(text)}.items():
        for key, value in values.items():
            cards.setdefault(index, {}).setdefault(key, value)
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


def _csv_cards(text: str) -> dict[int, dict[str, str]]:
    """Each 'device,...' header names the columns of the cardN rows below it (--csv of several
    queries prints one header per table)."""
    cards: dict[int, dict[str, str]] = {}
    columns: list[str] | None = None
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.split(",")]
        if cells[0].lower() == "device" and len(cells) > 1:
            columns = [cell.lower() for cell in cells]
        elif columns and (match := _CSV_ROW.match(line)) and len(cells) == len(columns):
            values = cards.setdefault(int(match.group(1)), {})
            for column, cell in zip(columns[1:], cells[1:], strict=True):
                values.setdefault(column, cell)
        else:
            columns = None if not line.strip() else columns
    return cards


def _table_cards(text: str) -> dict[int, dict[str, str]]:
    """Concise tables: the device id from a DID column (or the 'IDs (DID, GUID)' one), the gfx
    target and bus from values that can only be those, the codename from the wrapped name line."""
    cards: dict[int, dict[str, str]] = {}
    lines = text.splitlines()
    header: list[str] | None = None
    for number, line in enumerate(lines):
        if _TABLE_HEADER.match(line):
            header = line.split()
            continue
        if header is None:
            continue
        if re.match(r"^\s*=+\s*$", line) and cards:
            header = None  # the table's closing rule
            continue
        row = _TABLE_ROW.match(line)
        if not row:
            continue
        tokens = [token.rstrip(",") for token in line.split()]
        values = cards.setdefault(int(row.group(1)), {})
        did = _did_column(header)
        if did is not None and did < len(tokens) and re.fullmatch(r"(0x)?[0-9a-fA-F]{4}", tokens[did]):
            values["device id"] = tokens[did] if tokens[did].startswith("0x") else f"0x{tokens[did]}"
        if gfx := next((t for t in tokens if gfx_target(t)), None):
            values["gfx version"] = gfx
        if bus := next((t for t in tokens if re.fullmatch(r"[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]", t)), None):
            values["pci bus"] = bus
        following = lines[number + 1] if number + 1 < len(lines) else ""
        if "[Model" in " ".join(header) and following[:1].isspace() and following.strip():
            name = following.strip()
            if "[" in name:  # 'Navi 31 [Radeon RX 7': the pci.ids codename, then the cut product
                values["_chip"] = name.split("[", 1)[0].strip()
            if name.count("[") == name.count("]") and len(name) < _NAME_WIDTH:
                values["card series"] = name
    return cards


def _did_column(header: list[str]) -> int | None:
    """Where the device id sits among a row's tokens: 'DID' in --showhw, 'IDs' (DID, GUID) in
    6.1+ concise. Header words before it are one token per column, like the row's."""
    for position, word in enumerate(header):
        if word in ("DID", "IDs"):
            return position
    return None


def _gpu(index: int, values: dict[str, str]) -> Gpu:
    def first(*keys: str) -> str | None:
        return next((values[k] for k in keys if values.get(k) not in (None, "", "N/A")), None)

    name = first("card series", "card model", "marketing name", "device name")
    gpu = Gpu(vendor="amd", index=index, name=name if name and not name.startswith("0x") else None)
    gpu.arch = gfx_target(first("gfx version"))
    gpu.pci_id = pci_id(0x1002, to_int(first("device id", "gpu id", "card model")))
    gpu.bus_id = bus_id(first("pci bus"))
    if (total := to_int(first("vram total memory (b)"))) is not None and total > 0:
        gpu.vram_bytes = total
    codename = re.match(r"\s*([A-Z][a-z]+(?: \d+)?)\s*\[", name or "")
    gpu.chip = values.get("_chip") or (codename.group(1) if codename else None)
    return gpu
