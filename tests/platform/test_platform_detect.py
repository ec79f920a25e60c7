"""detect: merging GPUs across probes, provenance, disagreements, HSA override spoofing."""

from __future__ import annotations

import re

import pytest

from unsloth.platform import detect as detect_module
from unsloth.platform import identification as ident
from unsloth.platform.detect import detect
from unsloth.platform.facts import ProbeResult

TABLE = """| NVIDIA-SMI 570.133.07   Driver Version: 570.133.07   CUDA Version: 12.8 |
| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |
|   0  NVIDIA GeForce ...             Off |   00000000:01:00.0  On |                  Off |
|  0%   45C    P8             30W /  450W |     812MiB /  24564MiB |      0%      Default |
"""
CSV = "0, NVIDIA GeForce RTX 4090 D, 00000000:01:00.0, 0x268410DE, 24564, 8.9, 570.133.07, GPU-aa11\n"
ROCMINFO = """  Name:                    {gfx}
  Marketing Name:          AMD Radeon Graphics
  Device Type:             GPU
  Chip ID:                 {chip}
  BDFID:                   49408
"""
KFD = "== nodes/1/properties ==\ncpu_cores_count 0\nsimd_count 80\ngfx_target_version {v}\nlocation_id 49408\n"


def run(**texts: str):
    return detect(
        {name.replace("_", "-"): ProbeResult(name.replace("_", "-"), "ok", text) for name, text in texts.items()}
    )


def test_table_and_csv_views_of_one_gpu_are_merged():
    platform = run(nvidia_smi=TABLE, nvidia_smi_query=CSV)
    (gpu,) = platform.gpus
    assert gpu.sources == ["nvidia-smi-query", "nvidia-smi"]
    assert (gpu.name, gpu.arch, gpu.family, gpu.uuid) == ("NVIDIA GeForce RTX 4090 D", "sm_89", "Ada", "GPU-aa11")
    assert platform.provenance["nvidia_driver"] == "nvidia-smi-query"
    assert platform.provenance["cuda_driver"] == "nvidia-smi"


def test_truncated_name_gets_arch_only_from_a_pci_id():
    assert run(nvidia_smi=TABLE).gpus[0].arch is None
    lspci = "01:00.0 VGA compatible controller [0300]: NVIDIA Corporation Device [10de:2684] (rev a1)\n"
    (gpu,) = run(nvidia_smi=TABLE, lspci=lspci).gpus
    assert (gpu.arch, gpu.pci_id, gpu.sources) == ("sm_89", "10de:2684", ["nvidia-smi", "lspci"])


def test_gpus_at_different_bus_ids_stay_apart_in_tool_order():
    lspci = (
        "0e:00.0 VGA compatible controller [0300]: Advanced Micro Devices, Inc. [AMD/ATI] Raphael [1002:164e]\n"
        "01:00.0 VGA compatible controller [0300]: NVIDIA Corporation AD102 [GeForce RTX 4090] [10de:2684]\n"
    )
    platform = run(nvidia_smi=TABLE, lspci=lspci)
    assert [(g.vendor, g.bus_id) for g in platform.gpus] == [("nvidia", "0000:01:00.0"), ("amd", "0000:0e:00.0")]


def test_order_matching_never_merges_different_pci_ids():
    win = (
        "Name                    VideoProcessor\n----                    --------------\n"
        "AMD Radeon RX 7900 XTX  AMD Radeon Graphics Processor (0x744C)\n"
    )
    rocm = "GPU[0]\t\t: Card Series: \t\tRadeon RX 6700 XT\nGPU[0]\t\t: Device ID: \t0x73df\n"
    assert len(run(win32_videocontroller=win, rocm_smi=rocm).gpus) == 2


def test_spoof_is_found_and_the_real_arch_reported():
    platform = run(
        rocminfo=ROCMINFO.format(gfx="gfx1100", chip="5510(0x1586)"),
        kfd_topology=KFD.format(v=110501),
        env="HSA_OVERRIDE_GFX_VERSION=11.0.0",
    )
    (gpu,) = platform.gpus
    assert (gpu.arch, gpu.reported_arch, gpu.family) == ("gfx1151", "gfx1100", "RDNA3.5")
    assert (platform.hsa_override, platform.hsa_override_spoofs) == ("11.0.0", True)
    assert any("spoofing" in note for note in platform.notes)


def test_override_matching_the_hardware_is_not_a_spoof():
    platform = run(rocminfo=ROCMINFO.format(gfx="gfx1100", chip="29772(0x744c)"), env="HSA_OVERRIDE_GFX_VERSION=11.0.0")
    (gpu,) = platform.gpus
    assert (gpu.arch, gpu.reported_arch, platform.hsa_override_spoofs) == ("gfx1100", "gfx1100", False)


def test_with_an_override_and_nothing_else_the_real_arch_stays_unknown():
    platform = run(rocminfo=ROCMINFO.format(gfx="gfx1100", chip="0(0x0)"), env="HSA_OVERRIDE_GFX_VERSION=11.0.0")
    (gpu,) = platform.gpus
    assert (gpu.arch, gpu.reported_arch, gpu.family, platform.hsa_override_spoofs) == (None, "gfx1100", None, None)


def test_the_chip_id_alone_exposes_a_spoof():
    platform = run(rocminfo=ROCMINFO.format(gfx="gfx1030", chip="29663(0x73df)"))
    assert (platform.gpus[0].arch, platform.gpus[0].reported_arch, platform.hsa_override_spoofs) == (
        "gfx1031",
        "gfx1030",
        True,
    )


def test_integrated_gpu_reports_no_vram():
    rocm = ROCMINFO.format(gfx="gfx1151", chip="5510(0x1586)") + (
        "  Pool Info:\n    Pool 1\n      Segment:                 GLOBAL; FLAGS: COARSE GRAINED\n"
        "      Size:                    67108864(0x4000000) KB\n"
    )
    (gpu,) = run(rocminfo=rocm).gpus
    assert (gpu.integrated, gpu.vram_bytes) == (True, None)


def test_disagreements_are_noted_and_the_preferred_probe_wins():
    platform = run(
        host="sys.platform: linux\n",
        win32_videocontroller="Name : NVIDIA GeForce RTX 3090\n",
        nvidia_smi_query=CSV,
        proc_driver_nvidia_version="NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.14  Thu Feb 22 2024\n",
    )
    assert (platform.os, platform.provenance["os"]) == ("linux", "host")
    assert platform.nvidia_driver == "570.133.07"
    assert any(n.startswith("os: host says linux") for n in platform.notes)
    assert any(n.startswith("nvidia_driver:") and "550.54.14" in n for n in platform.notes)


def test_tool_failures_become_notes():
    platform = run(
        rocminfo="ROCk module is NOT loaded, possibly no GPU devices\n",
        nvidia_smi="Failed to initialize NVML: Driver/library version mismatch\n",
    )
    assert platform.gpus == []
    assert platform.notes == [
        "nvidia-smi failed: Failed to initialize NVML: Driver/library version mismatch",
        "rocminfo failed: ROCk module is NOT loaded, possibly no GPU devices",
    ]


def test_an_unknown_from_one_probe_does_not_hide_another_probes_value():
    query_log = "==============NVSMI LOG==============\nDriver Version : 550.54.14\nCUDA Version : 12.4\n"
    platform = run(nvidia_smi=TABLE.replace("12.8", "ERR!"), nvidia_smi_query=query_log)
    assert (platform.cuda_driver, platform.provenance["cuda_driver"]) == ("12.4", "nvidia-smi-query")
    assert run(nvidia_smi=TABLE.replace("12.8", "ERR!")).cuda_driver is None


def test_statuses_and_env_are_recorded():
    results = {
        "rocminfo": ProbeResult("rocminfo", "timeout"),
        "env": ProbeResult("env", "ok", "ROCR_VISIBLE_DEVICES=1\n"),
    }
    platform = detect(results)
    assert platform.probes == {"env": "ok", "rocminfo": "timeout"}
    assert platform.env == {"ROCR_VISIBLE_DEVICES": "1"}


def test_a_parser_bug_costs_only_its_own_probe(monkeypatch):
    real = detect_module.parser_for

    def broken(name):
        if name == "lspci":

            def parse(text):
                raise RuntimeError("boom")

            return parse
        return real(name)

    monkeypatch.setattr(detect_module, "parser_for", broken)
    platform = run(lspci="whatever", nvidia_smi=TABLE)
    assert len(platform.gpus) == 1 and platform.nvidia_driver == "570.133.07"
    assert platform.notes == ["lspci: could not be read (RuntimeError: boom)"]


def test_identification_tables_are_consistent():
    tables = ident.tables()
    for pci, row in tables["amd"]["pci"].items():
        assert re.fullmatch(r"[0-9a-f]{4}", pci) and ident.amd_family(row["gfx"]), pci
    for gfx in tables["amd"]["codename"].values():
        assert ident.amd_family(gfx)
    for row in tables["nvidia"]["names"]:
        re.compile(row["pattern"])
        assert ident.nvidia_family(row["cc"]), row
    assert all(ident.nvidia_family(cc) for cc in tables["nvidia"]["pci"].values())


@pytest.mark.parametrize(
    "name, cc",
    [
        ("NVIDIA GeForce RTX 4090", "8.9"),
        ("NVIDIA H200", "9.0"),
        ("NVIDIA H100 80GB HBM3", "9.0"),
        ("NVIDIA A100-SXM4-80GB", "8.0"),
        ("NVIDIA GeForce RTX 3090", "8.6"),
        ("Tesla T4", "7.5"),
        ("Tesla V100-SXM2-32GB", "7.0"),
        ("Tesla P100-PCIE-16GB", "6.0"),
        ("NVIDIA GeForce GTX 1080", "6.1"),
        ("NVIDIA GeForce RTX 5090", "12.0"),
        ("NVIDIA B200", "10.0"),
        ("NVIDIA GeForce GTX 970", "5.2"),
        ("NVIDIA L40S", "8.9"),
        ("NVIDIA RTX A6000", "8.6"),
        ("NVIDIA GeForce RTX 2080 Ti", "7.5"),
        ("NVIDIA GeForce ...", None),
        ("NVIDIA Graphics Device", None),
    ],
)
def test_nvidia_model_names(name, cc):
    assert (ident.nvidia_by_name(name) or {}).get("cc") == cc
