"""One parser per tool: raw text -> Findings. Pure; garbage yields unknown, never raises.

Each module exposes ``parse(text) -> Findings``. Each probe's row (``unsloth.platform.probes.PROBES``)
names the parser that reads its dump file; several probes may share one parser (amd-smi static/list/version).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from unsloth.platform.facts import Gpu


@dataclass
class Findings:
    """What one tool's output shows: its GPUs, and platform-level facts keyed by Platform field.

    ``facts`` may also hold hints detect uses but Platform does not store directly, named with a
    leading underscore: ``_error`` (the tool's own failure message, which detect notes),
    ``_registry_memory`` (Windows adapter sizes), ``_usr_lib_wsl`` (WSL's driver folder exists).
    """

    gpus: list[Gpu] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)


def to_int(text: str | None) -> int | None:
    """'30032(0x7550)' -> 30032, '0x744c' -> 29772, '24564' -> 24564; anything else -> None."""
    if text is None:
        return None
    match = re.match(r"\s*(0x[0-9a-fA-F]+|\d+)", text)
    if not match:
        return None
    return int(match.group(1), 0 if match.group(1).lower().startswith("0x") else 10)


def bus_id(text: str | None) -> str | None:
    """Normalise a PCI address to 'dddd:bb:dd.f' lower-case: nvidia-smi prints 8 domain digits,
    lspci none. None when the text is not an address."""
    if not text:
        return None
    match = re.search(r"(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])", text)
    if not match:
        return None
    domain = int(match.group(1) or "0", 16)
    return f"{domain:04x}:{match.group(2).lower()}:{match.group(3).lower()}.{match.group(4)}"


def pci_id(vendor: int | None, device: int | None) -> str | None:
    if vendor is None or device is None or not (0 < vendor <= 0xFFFF and 0 <= device <= 0xFFFF):
        return None
    return f"{vendor:04x}:{device:04x}"


def gfx_target(text: str | None) -> str | None:
    """An LLVM gfx target in either spelling tools print: 'gfx90a', or the decimal fields run
    together ('gfx9010': major 9, minor 0, stepping 10 -> gfx90a; 'gfx1100'). None otherwise."""
    match = re.fullmatch(r"\s*gfx([0-9a-f]{3,5})\s*", text or "", re.I)
    if not match:
        return None
    digits = match.group(1).lower()
    if not digits.isdigit():
        return f"gfx{digits}" if re.fullmatch(r"\d{1,2}[0-9a-f]{2}", digits) and len(digits) in (3, 4) else None
    major_len = 2 if digits[0] == "1" and len(digits) >= 4 else 1
    major, minor, stepping = int(digits[:major_len]), int(digits[major_len]), int(digits[major_len + 1 :])
    if not 7 <= major <= 15 or stepping > 15:
        return None
    return f"gfx{major}{minor:x}{stepping:x}"


VENDOR_IDS = {0x10DE: "nvidia", 0x1002: "amd", 0x1022: "amd", 0x8086: "intel", 0x106B: "apple"}


def vendor_from_name(name: str | None) -> str | None:
    """The vendor a marketing or pci.ids name names, or None."""
    lowered = (name or "").lower()
    if re.search(r"nvidia|geforce|quadro|tesla|titan|\brtx\b", lowered):
        return "nvidia"
    if re.search(r"\bamd\b|radeon|instinct|\bati\b|advanced micro devices", lowered):
        return "amd"
    if re.search(r"intel|\barc\b|iris|uhd graphics", lowered):
        return "intel"
    if re.search(r"\bapple\b", lowered):
        return "apple"
    return None


def product_vendor(name: str | None) -> str | None:
    """The vendor of a whole adapter name as the drivers' tools print one ('NVIDIA GeForce RTX 4090', 'AMD
    Radeon(TM) Graphics', 'Intel(R) Arc(TM) A770 Graphics'): two words or more, one of them a maker's or
    brand's long name. Short words alone ('rtx', 'amd x'), as random bytes can hold, name nothing."""
    if not name or len(name.split()) < 2 or not _LONG_BRAND.search(name):
        return None
    return vendor_from_name(name)


_LONG_BRAND = re.compile(r"nvidia|geforce|quadro|tesla|titan|radeon|instinct|firepro|intel|apple", re.I)


_QUOTE = re.compile(r"^[ \t]*(?:>[ \t]?)+", re.M)
_FENCE = re.compile(r"^[ \t]*(```|~~~).*$", re.M)


def unquote(text: str) -> str:
    """Output as pasted into an issue: markdown '> ' quote prefixes and code fences removed,
    when most lines carry the prefix (tool output itself does not start lines with '>')."""
    text = _FENCE.sub("", text)
    lines = [line for line in text.splitlines() if line.strip()]
    quoted = sum(1 for line in lines if line.lstrip().startswith(">"))
    if lines and quoted * 2 >= len(lines):
        text = _QUOTE.sub("", text)
    return text


def blocks(text: str, start: re.Pattern[str]) -> list[str]:
    """Split text into blocks, each beginning at a line that matches ``start``."""
    out: list[list[str]] = []
    for line in text.splitlines():
        if start.match(line):
            out.append([line])
        elif out:
            out[-1].append(line)
    return ["\n".join(block) for block in out]


def key_values(text: str, sep: str = ":") -> dict[str, str]:
    """'Key : value' lines -> {'key': 'value'} (keys lower-cased, first occurrence wins)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, found, value = line.partition(sep)
        if found and key.strip():
            out.setdefault(key.strip().lower(), value.strip())
    return out


@cache
def _registry() -> dict[str, Callable[[str], Findings]]:
    from unsloth.platform.probes import PARSERS  # each probe's row names its parser

    return PARSERS


def parser_for(name: str) -> Callable[[str], Findings] | None:
    return _registry().get(name)
