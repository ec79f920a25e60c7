"""Look-ups in data/identification.toml: what a PCI id, a codename or a model name fixes. Pure.

Only what a table states is returned; anything else is None (never a guess)."""

from __future__ import annotations

import re
import sys
from functools import cache
from importlib import resources
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@cache
def tables() -> dict[str, Any]:
    text = resources.files("unsloth").joinpath("data/identification.toml").read_text(encoding="utf-8")
    return tomllib.loads(text)


def amd_by_pci(pci_id: str | None) -> dict[str, Any] | None:
    """'1002:744c' -> {'gfx': 'gfx1100', 'chip': 'Navi 31', 'name': ..., 'integrated': False}."""
    if not pci_id or not pci_id.lower().startswith("1002:"):
        return None
    return tables()["amd"]["pci"].get(pci_id.lower()[5:])


def amd_gfx_by_codename(chip: str | None) -> str | None:
    return tables()["amd"]["codename"].get(chip or "")


def amd_family(gfx: str | None) -> str | None:
    return tables()["amd"]["family"].get(gfx or "")


def amd_legacy_family(name: str | None, chip: str | None) -> str | None:
    """The family of a pre-ROCm Radeon (GCN 1-4) named by its codename or marketing name, else None."""
    amd = tables()["amd"]
    if chip:
        for codename, family in amd["legacy_codename"].items():
            if re.fullmatch(rf"{re.escape(codename)}( (PRO|XT|XL|LE|GL|\w+))*", chip, re.I):
                return family
    for family, patterns in amd["legacy_names"].items():
        if name and any(re.search(p, name, re.I) for p in patterns):
            return family
    return None


def nvidia_family(cc: str | None) -> str | None:
    return tables()["nvidia"]["family"].get(cc or "")


def nvidia_sm(cc: str | None) -> str | None:
    """'8.9' -> 'sm_89', '12.0' -> 'sm_120'."""
    match = re.fullmatch(r"(\d+)\.(\d)", cc or "")
    return f"sm_{match.group(1)}{match.group(2)}" if match else None


def nvidia_by_name(name: str | None) -> dict[str, Any] | None:
    """The first name pattern that matches: {'cc': '8.9', 'integrated'?: bool}; None for unknown
    models. nvidia-smi cuts long names with '...': only what ends at a word break before the cut
    counts ('NVIDIA GeForce RTX 3060 ...' is a 3060; 'NVIDIA A10...' may be an A100, so nothing)."""
    if not name:
        return None
    stem, truncated = re.subn(r"\s*(\.\.\.|\u2026)\s*$", "", name)
    for row in tables()["nvidia"]["names"]:
        match = re.search(row["pattern"], stem, re.I)
        if match and (not truncated or _word_break_before_cut(name, match.end())):
            return row
    return None


def _word_break_before_cut(name: str, end: int) -> bool:
    """The match is a whole word of the name as printed: a separator, not the cut, follows it."""
    return end < len(name) and name[end] in " -_/("


def nvidia_cc_by_pci(pci_id: str | None) -> str | None:
    if not pci_id or not pci_id.lower().startswith("10de:"):
        return None
    return tables()["nvidia"]["pci"].get(pci_id.lower()[5:])


def intel_family(pci_id: str | None, name: str | None) -> str | None:
    """'Arc' for the Intel GPUs PyTorch's XPU build supports, by PCI id first, then by name; else None."""
    intel = tables()["intel"]
    if pci_id and pci_id.lower().startswith("8086:"):
        return "Arc" if pci_id.lower()[5:] in intel["arc_pci"] else None
    if name and any(re.search(p, name, re.I) for p in intel["arc_names"]):
        return "Arc"
    return None


def integrated_by_name(vendor: str, name: str | None) -> bool | None:
    """True/False when the name is one the vendor's table marks integrated/discrete, else None."""
    table = tables().get(vendor)
    if not name or not isinstance(table, dict) or "integrated_names" not in table:
        return None
    if any(re.search(p, name, re.I) for p in table["discrete_names"]):
        return False
    if any(re.search(p, name, re.I) for p in table["integrated_names"]):
        return True
    return None
