"""nvidia-smi parser: every output form, the OS/WSL evidence each carries, and failures."""

from __future__ import annotations

from unsloth.platform.parsers import nvidia_smi

LINUX_ROW = "|   0  NVIDIA GeForce RTX 4090        Off |   00000000:01:00.0  On |                  Off |"
MEMORY_ROW = "|  0%   45C    P8             30W /  450W |     812MiB /  24564MiB |      0%      Default |"
HEADER = "| NVIDIA-SMI {smi}   {driver_key} Version: {driver}   {cuda_key}: {cuda} |"
COLUMNS_LINUX = "| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |"


def table(
    smi="550.54.14",
    driver="550.54.14",
    cuda="12.4",
    driver_key="Driver",
    cuda_key="CUDA Version",
    columns=COLUMNS_LINUX,
    rows=(LINUX_ROW, MEMORY_ROW),
):
    return "\n".join(
        [HEADER.format(smi=smi, driver=driver, cuda=cuda, driver_key=driver_key, cuda_key=cuda_key), columns, *rows]
    )


def test_linux_table_gives_gpu_driver_cuda_and_os():
    found = nvidia_smi.parse(table())
    assert found.facts == {"nvidia_driver": "550.54.14", "cuda_driver": "12.4", "os": "linux"}
    (gpu,) = found.gpus
    assert (gpu.name, gpu.index, gpu.bus_id, gpu.vram_bytes) == (
        "NVIDIA GeForce RTX 4090",
        0,
        "0000:01:00.0",
        24564 * 2**20,
    )


def test_pasted_gpu_rows_without_header():
    found = nvidia_smi.parse(f"some text first\n{LINUX_ROW}\n{MEMORY_ROW}\n")
    assert [(g.name, g.vram_bytes) for g in found.gpus] == [("NVIDIA GeForce RTX 4090", 24564 * 2**20)]
    assert "os" not in found.facts  # the row alone does not show which layout it came from


def test_differing_smi_and_driver_versions_in_linux_layout_mean_wsl():
    found = nvidia_smi.parse(table(smi="565.57.02", driver="566.03"))
    assert found.facts["wsl"] is True and found.facts["nvidia_driver"] == "566.03"


def test_r610_header_kmd_and_cuda_umd_versions():
    found = nvidia_smi.parse(
        table(smi="610.43.02", driver="610.43.02", driver_key="KMD", cuda_key="CUDA UMD Version", cuda="13.2")
    )
    assert found.facts["nvidia_driver"] == "610.43.02"
    assert found.facts["cuda_driver"] == "13.2"
    assert "wsl" not in found.facts


def test_cuda_err_is_unknown_not_a_version():
    assert nvidia_smi.parse(table(cuda="ERR!")).facts["cuda_driver"] is None


def test_windows_layouts():
    wddm_row = "|   0  NVIDIA GeForce RTX 3090      WDDM  | 00000000:0A:00.0  On |                  N/A |"
    for columns in (
        "| GPU  Name            TCC/WDDM | Bus-Id        Disp.A | Volatile Uncorr. ECC |",
        "| GPU  Name                  Driver-Model | Bus-Id          Disp.A | Volatile Uncorr. ECC |",
    ):
        found = nvidia_smi.parse(table(columns=columns, rows=(wddm_row,)))
        assert found.facts["os"] == "windows" and found.facts["wsl"] is False
        assert found.gpus[0].name == "NVIDIA GeForce RTX 3090"


def test_list_form_skips_mig_devices():
    text = """GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-aaaa)
  MIG 3g.20gb     Device  0: (UUID: MIG-bbbb)
GPU 1: NVIDIA A100-SXM4-40GB (UUID: GPU-cccc)
"""
    found = nvidia_smi.parse(text)
    assert [(g.index, g.uuid) for g in found.gpus] == [(0, "GPU-aaaa"), (1, "GPU-cccc")]


def _query_log(persistence: str, model: str) -> str:
    return f"""==============NVSMI LOG==============
Driver Version                            : 560.81
CUDA Version                              : 12.6

Attached GPUs                             : 1
GPU 00000000:2B:00.0
    Product Name                          : NVIDIA GeForce RTX 4080
    Product Architecture                  : Ada Lovelace
    Persistence Mode                      : {persistence}
    Driver Model
        Current                           : {model}
        Pending                           : {model}
    GPU UUID                              : GPU-1a2b
    PCI
        Device Id                         : 0x270410DE
        Bus Id                            : 00000000:2B:00.0
    FB Memory Usage
        Total                             : 16376 MiB
"""


def test_query_log_fields():
    found = nvidia_smi.parse(_query_log("Enabled", "N/A"))
    (gpu,) = found.gpus
    assert (gpu.pci_id, gpu.bus_id, gpu.uuid, gpu.family, gpu.vram_bytes) == (
        "10de:2704",
        "0000:2b:00.0",
        "GPU-1a2b",
        "Ada",
        16376 * 2**20,
    )
    assert found.facts["nvidia_driver"] == "560.81" and found.facts["cuda_driver"] == "12.6"


def test_query_log_os_evidence():
    assert nvidia_smi.parse(_query_log("Enabled", "N/A")).facts["os"] == "linux"
    wsl = nvidia_smi.parse(_query_log("Enabled", "WDDM")).facts
    assert (wsl["os"], wsl["wsl"]) == ("linux", True)
    windows = nvidia_smi.parse(_query_log("N/A", "WDDM")).facts
    assert (windows["os"], windows["wsl"]) == ("windows", False)


def test_csv_in_the_probe_column_order():
    text = "0, NVIDIA H200, 00000000:19:00.0, 0x233510DE, 143771, 9.0, 570.124.06, GPU-4b2c\n"
    (gpu,) = nvidia_smi.parse(text).gpus
    assert (gpu.index, gpu.name, gpu.bus_id, gpu.pci_id, gpu.vram_bytes, gpu.compute_capability, gpu.uuid) == (
        0,
        "NVIDIA H200",
        "0000:19:00.0",
        "10de:2335",
        143771 * 2**20,
        "9.0",
        "GPU-4b2c",
    )
    assert nvidia_smi.parse(text).facts["nvidia_driver"] == "570.124.06"


def test_csv_with_header_and_units():
    text = "name, memory.total [MiB], driver_version\nTesla T4, 15360 MiB, 535.104.05\n"
    found = nvidia_smi.parse(text)
    assert [(g.name, g.vram_bytes) for g in found.gpus] == [("Tesla T4", 15360 * 2**20)]
    assert found.facts["nvidia_driver"] == "535.104.05"


def test_headerless_csv_of_other_columns_is_read_by_content():
    (gpu,) = nvidia_smi.parse("NVIDIA GeForce RTX 3090, 24576 MiB, 8.6\n").gpus
    assert (gpu.name, gpu.vram_bytes, gpu.compute_capability) == ("NVIDIA GeForce RTX 3090", 24576 * 2**20, "8.6")


def test_driver_failure_message_yields_nothing():
    text = (
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
        "Make sure that the latest NVIDIA driver is installed and running.\n"
    )
    found = nvidia_smi.parse(text)
    assert found.gpus == [] and found.facts == {"_error": text.strip()}
    mismatch = nvidia_smi.parse(
        "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: 570.86\n"
    )
    assert mismatch.facts == {"_error": "Failed to initialize NVML: Driver/library version mismatch"}
