"""lspci, Windows (Win32_VideoController, registry), macOS, kernel/os-release, host and env parsers."""

from __future__ import annotations

from pathlib import Path

import pytest

from unsloth.platform.parsers import host, lspci, os_files, system_profiler, win32

DUMPS = Path(__file__).resolve().parent.parent / "fixtures" / "dumps"


def test_lspci_names_ids_and_codename():
    (gpu,) = lspci.parse((DUMPS / "lspci__navi31__1" / "lspci.txt").read_text()).gpus
    assert (gpu.vendor, gpu.name, gpu.chip, gpu.pci_id, gpu.bus_id) == (
        "amd",
        "Radeon RX 7900 XT/7900 XTX",
        "Navi 31",
        "1002:744c",
        "0000:03:00.0",
    )


def test_lspci_skips_audio_and_reads_nnk():
    found = lspci.parse((DUMPS / "lspci__nnk_nvidia_audio_amd_igpu" / "lspci.txt").read_text())
    assert [(g.vendor, g.pci_id, g.name) for g in found.gpus] == [
        ("nvidia", "10de:2684", "GeForce RTX 4090"),
        ("amd", "1002:164e", "Raphael"),
    ]


def test_lspci_without_numeric_ids_and_with_domain():
    text = (
        "0000:65:00.0 VGA compatible controller: NVIDIA Corporation GA102 [GeForce RTX 3090] (rev a1)\n"
        "0001:00:00.0 3D controller: Advanced Micro Devices, Inc. [AMD/ATI] Aldebaran/MI200 [Instinct MI250X]\n"
    )
    found = lspci.parse(text)
    assert [(g.vendor, g.name, g.pci_id, g.bus_id) for g in found.gpus] == [
        ("nvidia", "GeForce RTX 3090", None, "0000:65:00.0"),
        ("amd", "Instinct MI250X", None, "0001:00:00.0"),
    ]


def test_lspci_vvv_vga_line_with_prog_if():
    text = (
        "0000:01:00.0 VGA compatible controller [0300]: NVIDIA Corporation AD102 [GeForce RTX 4090] [10de:2684]"
        " (rev a1) (prog-if 00 [VGA controller])\n\tSubsystem: Gigabyte Technology Co., Ltd Device [1458:40bf]\n"
    )
    (gpu,) = lspci.parse(text).gpus
    assert (gpu.name, gpu.chip, gpu.pci_id) == ("GeForce RTX 4090", "AD102", "10de:2684")


def test_lspci_instinct_as_processing_accelerator():
    text = (
        "0000:0c:00.0 Processing accelerators [1200]: Advanced Micro Devices, Inc. [AMD/ATI] Aqua Vanjaram "
        "[Instinct MI300X] [1002:74a1]\n"
        "0000:c1:00.1 Signal processing controller [1180]: Advanced Micro Devices, Inc. [AMD] Strix/Krackan/Strix "
        "Halo Neural Processing Unit [1022:17f0] (rev 10)\n"
        "0000:4d:00.0 Processing accelerators [1200]: Intel Corporation Gaudi2 AI Training Accelerator [8086:1020]\n"
    )
    assert [(g.name, g.pci_id) for g in lspci.parse(text).gpus] == [("Instinct MI300X", "1002:74a1")]


def test_lspci_unresolved_device_has_no_name():
    (gpu,) = lspci.parse((DUMPS / "lspci__device_7550_unresolved" / "lspci.txt").read_text()).gpus
    assert (gpu.name, gpu.chip, gpu.pci_id) == (None, None, "1002:7550")


def test_win32_format_table_with_video_processor_ids():
    found = win32.parse((DUMPS / "Get-WmiObject__gfx1036+gfx1100_windows__1" / "win32-videocontroller.txt").read_text())
    assert [(g.name, g.pci_id) for g in found.gpus] == [
        ("AMD Radeon(TM) Graphics", "1002:164e"),
        ("AMD Radeon RX 7900 XTX", "1002:744c"),
    ]
    assert found.facts["os"] == "windows"


def test_wmic_table_with_saturated_adapter_ram():
    found = win32.parse((DUMPS / "wmic__table_adapterram_saturated" / "win32-videocontroller.txt").read_text())
    assert [(g.vendor, g.pci_id, g.vram_bytes) for g in found.gpus] == [
        ("nvidia", "10de:2684", None),
        ("intel", "8086:a780", 1073741824),
    ]


def test_cim_list_skips_software_adapters():
    found = win32.parse((DUMPS / "cim__list_registry_qwmemorysize" / "win32-videocontroller.txt").read_text())
    assert [(g.name, g.pci_id, g.vram_bytes) for g in found.gpus] == [("AMD Radeon RX 7900 XTX", "1002:744c", None)]


def test_wmic_format_list():
    text = "\r\n\r\nAdapterRAM=2147483648\r\nName=NVIDIA GeForce GTX 1070\r\nPNPDeviceID=PCI\\VEN_10DE&DEV_1B81\r\n\r\n"
    (gpu,) = win32.parse(text.replace("\r\n", "\n")).gpus
    assert (gpu.name, gpu.pci_id, gpu.vram_bytes) == ("NVIDIA GeForce GTX 1070", "10de:1b81", 2147483648)


@pytest.mark.parametrize(
    "dump, memory",
    [
        ("cim__list_registry_qwmemorysize", [("AMD Radeon RX 7900 XTX", 25753026560)]),
        (
            "reg__query_form_with_wmiobject_list",
            [("NVIDIA GeForce RTX 3080", 10 * 2**30), ("AMD Radeon(TM) Graphics", 512 * 2**20)],
        ),
    ],
)
def test_registry_qwmemorysize_forms(dump, memory):
    facts = win32.parse_registry((DUMPS / dump / "win-registry-video.txt").read_text()).facts
    assert facts["_registry_memory"] == memory


def test_system_profiler_apple_and_intel_mac():
    (apple,) = system_profiler.parse((DUMPS / "macos__apple_m2" / "system-profiler.txt").read_text()).gpus
    assert (apple.vendor, apple.name, apple.integrated, apple.pci_id) == ("apple", "Apple M2", True, None)
    intel, radeon = system_profiler.parse(
        (DUMPS / "macos__intel_with_radeon_pro" / "system-profiler.txt").read_text()
    ).gpus
    assert (intel.vendor, intel.integrated, intel.vram_bytes) == ("intel", True, None)
    assert (radeon.vendor, radeon.integrated, radeon.pci_id, radeon.vram_bytes) == (
        "amd",
        False,
        "1002:7340",
        8 * 2**30,
    )


@pytest.mark.parametrize(
    "text, facts",
    [
        (
            "Linux version 4.4.0-19041-Microsoft (Microsoft@Microsoft.com) (gcc version 5.4.0 (GCC) ) #1237-Microsoft",
            {"os": "linux", "kernel": "4.4.0-19041-Microsoft", "wsl": True, "wsl_version": 1},
        ),
        (
            "Linux version 4.19.67-microsoft-standard (oe-user@oe-host) (gcc version 8.2.0 (GCC)) #1 SMP",
            {"os": "linux", "kernel": "4.19.67-microsoft-standard", "wsl": True, "wsl_version": 2},
        ),
        (
            "Linux version 6.6.87.2-microsoft-standard-WSL2 (root@439a258ad544) (gcc (GCC) 11.2.0) #1 SMP",
            {"os": "linux", "kernel": "6.6.87.2-microsoft-standard-WSL2", "wsl": True, "wsl_version": 2},
        ),
        (
            "Linux box 6.8.0-45-generic #45-Ubuntu SMP PREEMPT_DYNAMIC Fri Aug 30 2024 x86_64 x86_64 x86_64 GNU/Linux",
            {"os": "linux", "kernel": "6.8.0-45-generic", "wsl": False, "machine": "x86_64"},
        ),
        ("Darwin mac.local 23.4.0 Darwin Kernel Version 23.4.0 arm64", {"os": "macos", "wsl": False}),
        ("MINGW64_NT-10.0-22631 host 3.4.10.x86_64 2024-02-10 08:39 UTC x86_64 Msys", {"os": "windows", "wsl": False}),
        ("", {}),
    ],
)
def test_kernel_strings(text, facts):
    assert os_files.parse_kernel(text).facts == facts


def test_os_release_and_device_nodes():
    assert (
        os_files.parse_os_release('NAME="Ubuntu"\nPRETTY_NAME="Ubuntu 24.04.1 LTS"\n').facts["distro"]
        == "Ubuntu 24.04.1 LTS"
    )
    facts = os_files.parse_device_nodes("/dev/kfd: present\n/dev/dxg: absent\n/usr/lib/wsl: absent\n").facts
    assert (facts["dev_kfd"], facts["dev_dxg"], "wsl" in facts) == (True, False, False)


def test_host_and_env():
    facts = host.parse_host(
        "sys.platform: win32\nmachine: AMD64\ncpu: Intel64 Family 6\nram_bytes: 68719476736\n"
    ).facts
    assert facts == {"os": "windows", "machine": "AMD64", "cpu": "Intel64 Family 6", "ram_bytes": 68719476736}
    env = host.parse_env(
        "HSA_OVERRIDE_GFX_VERSION=11.0.0\nHSA_OVERRIDE_GFX_VERSION_1=10.3.0\nPATH=/usr/bin\nROCR_VISIBLE_DEVICES=0\n"
    ).facts
    assert env["env"] == {
        "HSA_OVERRIDE_GFX_VERSION": "11.0.0",
        "HSA_OVERRIDE_GFX_VERSION_1": "10.3.0",
        "ROCR_VISIBLE_DEVICES": "0",
    }
    assert env["hsa_override"] == "11.0.0"
