"""The facts detection produces: one Platform holding every GPU, with where each fact came from.

These types are the contract between detection (parsers, detect) and everything after it
(plan, doctor, installer). What the evidence does not show stays None: never guess.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Gpu:
    vendor: str  # "nvidia" | "amd" | "intel" | "apple"
    name: str | None = None
    arch: str | None = None  # "gfx1100" | "sm_86": the real silicon, never an HSA override
    family: str | None = None  # "RDNA3", "CDNA3", "Ada", ... (see docs/json.md)
    vram_bytes: int | None = None
    integrated: bool | None = None
    pci_id: str | None = None  # "1002:744c", lower-case
    compute_capability: str | None = None  # NVIDIA only: "8.9"
    bus_id: str | None = None  # "0000:03:00.0" where a tool printed it
    uuid: str | None = None
    index: int | None = None  # the tool's own ordinal (nvidia-smi index, rocminfo GPU order)
    reported_arch: str | None = None  # what the runtime reported when an override changed it
    chip: str | None = None  # codename a tool printed: "Navi 31", "AD102"
    kfd_node: int | None = None  # AMD: KFD topology node id (rocminfo "Node:"), what HSA_OVERRIDE_GFX_VERSION_<n> names
    sources: list[str] = field(default_factory=list)  # probes that contributed to this GPU

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ProbeResult:
    """What running one probe gave: the raw text, or why there is none."""

    name: str  # dump file stem, e.g. "nvidia-smi", "rocminfo"
    status: str  # "ok" | "absent" | "failed" | "timeout"
    text: str = ""
    detail: str = ""  # exit code, error message, the command line


@dataclass
class Platform:
    os: str | None = None  # "linux" | "windows" | "macos"
    wsl: bool | None = None
    wsl_version: int | None = None  # 1 | 2
    machine: str | None = None  # "x86_64" | "aarch64" | "arm64" | "AMD64"
    kernel: str | None = None
    distro: str | None = None  # os-release PRETTY_NAME
    cpu: str | None = None
    ram_bytes: int | None = None
    nvidia_driver: str | None = None  # "580.126.09"; under WSL the Windows host driver
    cuda_driver: str | None = None  # highest CUDA the driver supports: "13.0"
    rocm_version: str | None = None  # "6.4.0"
    rocm_installed: bool | None = None  # a ROCm tool answered (its version may still be unknown)
    gpus: list[Gpu] = field(default_factory=list)
    # Environment variables that change what the runtime sees (HSA_OVERRIDE_GFX_VERSION,
    # CUDA_VISIBLE_DEVICES, HIP_VISIBLE_DEVICES, ROCR_VISIBLE_DEVICES, ...), as they were set.
    env: dict[str, str] = field(default_factory=dict)
    hsa_override: str | None = None  # the override value, e.g. "11.0.0"
    hsa_override_spoofs: bool | None = None  # True when it changes what the runtime reports
    dev_kfd: bool | None = None  # /dev/kfd present (Linux ROCm)
    dev_dxg: bool | None = None  # /dev/dxg present (WSL2 GPU bridge)
    provenance: dict[str, str] = field(default_factory=dict)  # fact name -> probe that said it
    probes: dict[str, str] = field(default_factory=dict)  # probe name -> status
    notes: list[str] = field(default_factory=list)  # disagreements between probes, and such

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["gpus"] = [gpu.to_json() for gpu in self.gpus]
        return data
