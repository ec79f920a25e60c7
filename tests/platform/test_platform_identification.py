"""What the identification tables fix from a name, a codename or an id, and what they leave unknown."""

from __future__ import annotations

import pytest

from unsloth.platform import identification as ident
from unsloth.platform.parsers import gfx_target


@pytest.mark.parametrize(
    ("name", "cc"),
    [
        ("NVIDIA GeForce RTX 3060 ...", "8.6"),  # cut after the model number
        ("NVIDIA GeForce GTX 1650 ...", "7.5"),
        ("NVIDIA A100-SXM4-8...", "8.0"),
        ("NVIDIA GeForce ...", None),  # cut before it
        ("NVIDIA A10...", None),  # may be an A100: the cut ends the word
        ("NVIDIA GeForce RTX 30...", None),
        ("GeForce GTX 680", "3.0"),  # old drivers: no "NVIDIA " prefix
        ("Quadro RTX 4000", "7.5"),
        ("NVIDIA GeForce MX250", "6.1"),  # MX250 is Pascal
        ("NVIDIA GeForce MX450", "7.5"),
        ("Orin (nvgpu)", "8.7"),
        ("Tesla K80", "3.7"),
        ("NVIDIA RTX A1000 Laptop GPU", "8.6"),
    ],
)
def test_nvidia_names(name, cc):
    assert (ident.nvidia_by_name(name) or {}).get("cc") == cc


@pytest.mark.parametrize(
    ("text", "gfx"),
    [("gfx90a", "gfx90a"), ("gfx9010", "gfx90a"), ("gfx9012", "gfx90c"), ("gfx1100", "gfx1100"), ("gfx942", "gfx942"),
     ("gfx803", "gfx803"), ("gfx10", None), ("gfxzz", None), ("gfx9016", None), ("Navi 31", None)],
)
def test_gfx_targets_in_both_spellings(text, gfx):
    assert gfx_target(text) == gfx


@pytest.mark.parametrize(
    ("name", "chip", "family"),
    [("AMD Radeon R9 390 Series", None, "GCN"), ("Radeon RX 580 Series", None, "GCN"), (None, "Hawaii PRO", "GCN"),
     (None, "Ellesmere", "GCN"), ("AMD Radeon RX 5700 XT", None, None), ("AMD Radeon RX 7900 XTX", None, None),
     (None, "Navi 31", None)],
)
def test_gcn_radeons_by_name_or_codename(name, chip, family):
    assert ident.amd_legacy_family(name, chip) == family


@pytest.mark.parametrize(
    ("pci_id", "name", "family"),
    [("8086:e20b", None, "Arc"), ("8086:a780", "Arc B580", None),  # the id beats the name
     (None, "Intel(R) Arc(TM) 140V GPU (16GB)", "Arc"), (None, "Intel(R) Arc(TM) A770 Graphics", "Arc"),
     (None, "Intel(R) UHD Graphics 770", None), (None, "Intel(R) Iris(R) Xe Graphics", None)],
)
def test_intel_gpus_pytorchs_xpu_build_supports(pci_id, name, family):
    assert ident.intel_family(pci_id, name) == family
