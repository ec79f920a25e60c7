"""AMD parsers: rocminfo, KFD, rocm-smi, amd-smi, hipconfig, /opt/rocm/.info/version, DRM."""

from __future__ import annotations

from pathlib import Path

import pytest

from unsloth.platform.parsers import amd_smi, drm, hipconfig, kfd, rocm_smi, rocm_version, rocminfo

DUMPS = Path(__file__).resolve().parent.parent / "fixtures" / "dumps"


def test_rocminfo_excerpt_without_agent_header():
    (gpu,) = rocminfo.parse((DUMPS / "rocminfo__gfx1201__1" / "rocminfo.txt").read_text()).gpus
    assert (gpu.arch, gpu.name, gpu.pci_id, gpu.uuid) == (
        "gfx1201",
        "AMD Radeon RX 9070 XT",
        "1002:7550",
        "GPU-33cdcaebba902e5f",
    )


def test_rocminfo_skips_cpu_agents_and_decodes_bdfid():
    found = rocminfo.parse((DUMPS / "rocminfo__multi_radeon_with_cpu" / "rocminfo.txt").read_text())
    assert [(g.arch, g.bus_id, g.index) for g in found.gpus] == [
        ("gfx1100", "0000:03:00.0", 0),
        ("gfx1031", "0000:0b:00.0", 1),
    ]
    assert found.gpus[0].vram_bytes == 25149440 * 1024
    assert found.facts["os"] == "linux"


def test_rocminfo_placeholder_uuid_is_not_an_identity():
    text = "  Name:                    gfx1100\n  Uuid:                    GPU-XX\n  Device Type:             GPU\n"
    assert rocminfo.parse(text).gpus[0].uuid is None


def test_rocminfo_failure_is_a_fact_not_a_gpu():
    found = rocminfo.parse("ROCk module is NOT loaded, possibly no GPU devices\n")
    assert found.gpus == []
    assert found.facts["_error"] == "ROCk module is NOT loaded, possibly no GPU devices"


def test_rocminfo_headless_fragment_is_not_a_gpu():
    text = "  Chip ID:                 29772(0x744c)\n  Max Clock Freq. (MHz):   2482\n"
    assert rocminfo.parse(text).gpus == []


@pytest.mark.parametrize(
    "value, gfx",
    [
        (90010, "gfx90a"),
        (90008, "gfx908"),
        (90402, "gfx942"),
        (100300, "gfx1030"),
        (100301, "gfx1031"),
        (110000, "gfx1100"),
        (110003, "gfx1103"),
        (110501, "gfx1151"),
        (120001, "gfx1201"),
        (0, None),
        (1234567, None),
    ],
)
def test_kfd_gfx_target_version_decoding(value, gfx):
    assert kfd.gfx_from_target_version(value) == gfx


def test_kfd_apu_node_with_cpu_cores_is_integrated():
    text = (
        "== nodes/0/properties ==\ncpu_cores_count 8\nsimd_count 24\ngfx_target_version 110003\n"
        "vendor_id 4098\ndevice_id 5567\nlocation_id 50176\ndomain 0\n"
    )
    (gpu,) = kfd.parse(text).gpus
    assert (gpu.arch, gpu.integrated, gpu.pci_id, gpu.bus_id) == ("gfx1103", True, "1002:15bf", "0000:c4:00.0")


def test_kfd_single_properties_file_without_header():
    (gpu,) = kfd.parse("cpu_cores_count 0\nsimd_count 192\ngfx_target_version 110000\n").gpus
    assert gpu.arch == "gfx1100" and gpu.integrated is None


def test_rocm_smi_text_and_json_agree():
    text = rocm_smi.parse((DUMPS / "rocm-smi__text__mi300x_x2" / "rocm-smi.txt").read_text())
    assert [(g.name, g.arch, g.pci_id, g.bus_id) for g in text.gpus] == [
        ("AMD Instinct MI300X OAM", "gfx942", "1002:74a1", "0000:0c:00.0"),
        ("AMD Instinct MI300X OAM", "gfx942", "1002:74a1", "0000:22:00.0"),
    ]
    assert "rocm_version" not in text.facts  # 'Driver version' is amdgpu's
    (gpu,) = rocm_smi.parse((DUMPS / "rocm-smi__json__7900xtx" / "rocm-smi.txt").read_text()).gpus
    assert (gpu.arch, gpu.pci_id, gpu.bus_id, gpu.vram_bytes) == ("gfx1100", "1002:744c", "0000:03:00.0", 25753026560)


def test_amd_smi_static():
    (gpu,) = amd_smi.parse((DUMPS / "amd-smi__static__7900xtx" / "amd-smi.txt").read_text()).gpus
    assert (gpu.name, gpu.arch, gpu.pci_id, gpu.bus_id, gpu.vram_bytes) == (
        "AMD Radeon RX 7900 XTX",
        "gfx1100",
        "1002:744c",
        "0000:03:00.0",
        24560 * 2**20,
    )


def test_amd_smi_list_and_version():
    found = amd_smi.parse((DUMPS / "amd-smi__list_and_version" / "amd-smi-list.txt").read_text())
    assert [g.bus_id for g in found.gpus] == ["0000:03:00.0", "0000:83:00.0"]
    version = amd_smi.parse(
        "AMDSMI Tool: 24.7.1 | AMDSMI Library version: 24.7.1.0 | ROCm version: 6.4.0 | "
        "amdgpu version: 6.10.5 | amd_hsmp version: N/A"
    )
    assert version.facts["rocm_version"] == "6.4.0" and version.gpus == []


def test_amd_smi_json():
    text = (
        '[{"gpu": 0, "asic": {"market_name": "AMD Instinct MI300X", "vendor_id": "0x1002", "device_id": "0x74a1",'
        ' "target_graphics_version": "gfx942"}, "bus": {"bdf": "0000:0c:00.0"}}]'
    )
    (gpu,) = amd_smi.parse(text).gpus
    assert (gpu.name, gpu.arch, gpu.pci_id, gpu.bus_id) == (
        "AMD Instinct MI300X",
        "gfx942",
        "1002:74a1",
        "0000:0c:00.0",
    )


@pytest.mark.parametrize(
    "text, version",
    [
        ("6.0.32830-d62f6a171", "6.0"),
        ("HIP version: 6.2.41134-65d174c3e\n", "6.2"),
        ("7.2.53211-9999", "7.2"),
        ("hipconfig: command not found", None),
    ],
)
def test_hipconfig_gives_major_minor_only(text, version):
    assert hipconfig.parse(text).facts.get("rocm_version") == version


def test_rocm_version_file():
    assert rocm_version.parse("6.4.0-47\n").facts["rocm_version"] == "6.4.0"
    assert rocm_version.parse("not a version").facts == {}


def test_drm_cards():
    text = (
        "== /sys/class/drm/card0/device ==\npci_address: 0000:03:00.0\nvendor: 0x1002\ndevice: 0x744c\n"
        "class: 0x030000\nmem_info_vram_total: 25753026560\n"
        "== /sys/class/drm/card1/device ==\npci_address: 0000:00:02.0\nvendor: 0x1a03\ndevice: 0x2000\n"
    )
    (gpu,) = drm.parse(text).gpus  # the ASPEED BMC chip is not a compute GPU
    assert (gpu.vendor, gpu.pci_id, gpu.bus_id, gpu.vram_bytes) == ("amd", "1002:744c", "0000:03:00.0", 25753026560)
