"""Platform x hardware matrix -> Plan: what to install and how, and how well it is supported. Pure.

`resolve` reads no files, runs nothing and looks at no environment: detection gives the Platform,
`unsloth.matrix.load_matrix` gives the data, and user pins arrive as `Overrides`.

Choosing the compute device when there are several GPUs (one device, one torch backend):
  1. GPUs the matrix supports on this OS beat unsupported ones, "full" beats "limited";
  2. discrete beats integrated (a laptop's dGPU over its iGPU);
  3. NVIDIA beats AMD beats others (the CUDA stack is the most complete);
  4. more VRAM wins; then the tool's own order.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from packaging.version import InvalidVersion, Version

from unsloth.matrix import CudaIndex, Family, Matrix, RocmIndex, SupportCell
from unsloth.platform.facts import Gpu, Platform

GIB = 2**30
_LEVEL_RANK = {"full": 2, "limited": 1, "unsupported": 0}
_VENDOR_RANK = {"nvidia": 2, "amd": 1}
# Probes (detection's dump names) that only answer when ROCm is installed.
ROCM_TOOLS = (
    "rocminfo",
    "rocminfo-no-override",
    "amd-smi",
    "amd-smi-list",
    "amd-smi-version",
    "rocm-smi",
    "rocm-smi-json",
    "hipconfig",
    "rocm-version",
)
_LLAMA_BACKEND = {"cuda": "cuda", "rocm": "hip", "mps": "metal", "cpu": "cpu"}


@dataclass
class Advice:
    """A warning the user should act on, with the exact fix."""

    message: str
    fix: str | None = None
    check: str | None = None  # the doctor check that judges the same fact, so doctor says it once


@dataclass
class TorchChoice:
    backend: str  # "cuda" | "rocm" | "cpu" | "mps" | "xpu"
    variant: str | None  # index leaf: "cu128", "rocm6.4", "cpu"
    index_url: str | None  # the only index torch-family packages may come from
    version_spec: str | None = None  # "torch>=2.8,<2.12"
    packages: list[str] = field(default_factory=lambda: ["torch"])


@dataclass
class Plan:
    support: str  # "full" | "limited" | "unsupported"
    reason: str
    device: Gpu | None  # the compute device chosen, None for CPU
    device_reason: str
    torch: TorchChoice
    bitsandbytes: dict[str, Any]  # {"source": "pypi"|"none", "spec": ..., "note": ...}
    llama_cpp: dict[str, Any]  # {"backend": "cuda"|"hip"|"vulkan"|"metal"|"cpu", "cmake_args": ..., "how": ...}
    attention: str  # "sdpa" | "flash_attention_2" | "eager"
    env: dict[str, str]
    warnings: list[Advice] = field(default_factory=list)
    fits: dict[str, Any] = field(default_factory=dict)  # model sizes the VRAM fits, per method
    sources: list[str] = field(default_factory=list)  # the matrix rows' citations
    os: str | None = None  # the matrix OS cell: "linux" | "wsl" | "windows" | "macos"
    family: str | None = None  # the matrix family planned for ("RDNA3", "Ada", "CPU", ...)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Overrides:
    """User pins, as the installer reads them from the environment (see `from_env`)."""

    torch_index_url: str | None = None  # used verbatim; skips index selection
    pytorch_mirror: str | None = None  # replaces https://download.pytorch.org/whl
    amd_mirror: str | None = None  # replaces https://repo.amd.com/rocm/whl

    ENV: ClassVar[dict[str, str]] = {
        "torch_index_url": "UNSLOTH_TORCH_INDEX_URL",
        "pytorch_mirror": "UNSLOTH_PYTORCH_MIRROR",
        "amd_mirror": "UNSLOTH_AMD_ROCM_MIRROR",
    }

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Overrides:
        return cls(**{name: (environ.get(var) or "").strip() or None for name, var in cls.ENV.items()})


@dataclass
class _Candidate:
    gpu: Gpu
    family: Family | None
    cell: SupportCell | None
    position: int

    @property
    def label(self) -> str:
        details = ", ".join(x for x in (self.gpu.arch, self.family.name if self.family else None) if x)
        name = self.gpu.name or f"{self.gpu.vendor} GPU"
        return f"{name} ({details})" if details else name

    def rank(self) -> tuple:
        level = _LEVEL_RANK[self.cell.level] if self.cell else -1
        return (
            level,
            not self.gpu.integrated,
            _VENDOR_RANK.get(self.gpu.vendor, 0),
            self.gpu.vram_bytes or 0,
            -self.position,
        )


def support_phrase(level: str) -> str:
    """A support level as prose: "full support", "limited support", "unsupported"."""
    return level if level == "unsupported" else f"{level} support"


def os_cell(platform: Platform) -> str:
    """The matrix OS column for a platform: WSL is its own column."""
    if platform.os == "linux" and platform.wsl:
        return "wsl"
    return platform.os or "linux"


def resolve(platform: Platform, matrix: Matrix, *, overrides: Overrides | Mapping[str, str] | None = None) -> Plan:
    """Decide what to install for this platform, and say how well it is supported and why."""
    pins = overrides if isinstance(overrides, Overrides) else Overrides(**dict(overrides or {}))
    return _Resolver(platform, matrix, pins).plan()


class _Resolver:
    def __init__(self, platform: Platform, matrix: Matrix, pins: Overrides):
        self.platform, self.matrix, self.pins = platform, matrix, pins
        self.os = os_cell(platform)
        self.warnings: list[Advice] = []
        self.sources: list[str] = []
        self.env: dict[str, str] = {}
        self.pytorch = (pins.pytorch_mirror or matrix.urls["pytorch"]).rstrip("/")
        self.amd = (pins.amd_mirror or matrix.urls["amd"]).rstrip("/")
        self.effective_arch: str | None = None  # the gfx target the ROCm runtime will load kernels for

    def warn(self, message: str, fix: str | None = None, check: str | None = None) -> None:
        self.warnings.append(Advice(message, fix, check))

    def cite(self, source: str) -> None:
        if source not in self.sources:
            self.sources.append(source)

    # --- the whole plan -------------------------------------------------------------------------

    def plan(self) -> Plan:
        if self.platform.os not in self.matrix.oses:
            self.warn(
                "The operating system was not detected; planning for Linux.",
                "Run `unsloth detect` to see what the probes found.",
            )
        chosen, device_reason = self.choose_device()
        torch = self.torch_choice(chosen) if chosen else None
        if torch is not None:
            device, family, cell = chosen.gpu, chosen.family, chosen.cell
            support, reason = cell.level, cell.reason
        else:  # no usable GPU: a CPU build (MPS on Apple silicon)
            device, self.env, self.effective_arch = None, {}, None  # nothing GPU-specific survives
            family, cell = self.host_fallback()
            torch = self.host_torch(family)
            support, reason = cell.level, cell.reason
            if chosen and chosen.cell.level == "unsupported":
                family, cell = chosen.family, chosen.cell
                support, reason = "unsupported", f"{chosen.label}: {cell.reason}; installing CPU PyTorch"
            elif chosen:
                reason = f"{chosen.label} cannot be used yet (see warnings); until then: {reason}"
        self.cite(cell.source)
        self.check_user_env(family.vendor if family else None)
        torch = self.apply_pins(torch)
        bitsandbytes = self.bitsandbytes_choice(torch, device)
        return Plan(
            support=support,
            reason=reason,
            device=device,
            device_reason=device_reason,
            torch=torch,
            bitsandbytes=bitsandbytes,
            llama_cpp=self.llama_cpp_choice(torch),
            attention=self.matrix.attention.get(torch.backend, "sdpa"),
            env=dict(sorted(self.env.items())),
            warnings=self.warnings,
            fits=self.fits(device, bitsandbytes["source"] != "none"),
            sources=self.sources,
            os=self.os,
            family=family.name if family else None,
        )

    # --- which device ---------------------------------------------------------------------------

    def classify(self, gpu: Gpu, position: int) -> _Candidate:
        family = self.matrix.families.get(gpu.family or "") or (self.matrix.family_of(gpu.arch) if gpu.arch else None)
        if family is None and gpu.vendor == "nvidia" and gpu.compute_capability:
            family = self.matrix.family_of("sm_" + gpu.compute_capability.replace(".", ""))
        if family is None:  # vendors the matrix keeps as one family without archs (Intel, Apple)
            family = next((f for f in self.matrix.families.values() if f.vendor == gpu.vendor and not f.archs), None)
        cell = self.matrix.support.get((family.name, self.os)) if family else None
        return _Candidate(gpu, family, cell, position)

    def choose_device(self) -> tuple[_Candidate | None, str]:
        candidates = [self.classify(gpu, n) for n, gpu in enumerate(self.platform.gpus)]
        for candidate in candidates:
            if candidate.family is None and candidate.gpu.vendor == "amd":
                self.warn(
                    f"{candidate.label}: the AMD GPU's gfx target could not be read, "
                    "so no ROCm build can be chosen for it.",
                    f"Install ROCm ({self.matrix.urls['rocm_install']}) so `rocminfo` can name the gfx target, "
                    "then re-run `unsloth install`.",
                )
        usable = [c for c in candidates if c.family and c.cell]
        unnamed_nvidia = [c for c in candidates if c.family is None and c.gpu.vendor == "nvidia"]
        if not usable and unnamed_nvidia and self.platform.nvidia_driver:
            return self.unidentified_nvidia(unnamed_nvidia[0])
        if not usable:
            if candidates:
                return None, "no GPU the hardware matrix knows: " + ", ".join(c.label for c in candidates)
            return None, "no GPU detected"
        best = max(usable, key=_Candidate.rank)
        if len(candidates) == 1:
            return best, f"{best.label}: the only GPU"
        others = [c for c in candidates if c is not best]
        why = []
        for other in others:
            if other.cell is None:
                why.append(f"{other.label}: unknown to the matrix")
            elif other.cell.level != best.cell.level and _LEVEL_RANK[other.cell.level] < _LEVEL_RANK[best.cell.level]:
                why.append(f"{other.label}: {other.cell.level} on {self.os}")
            elif other.gpu.integrated and not best.gpu.integrated:
                why.append(f"{other.label}: integrated")
            elif _VENDOR_RANK.get(other.gpu.vendor, 0) < _VENDOR_RANK.get(best.gpu.vendor, 0):
                why.append(f"{other.label}: NVIDIA CUDA preferred over {other.gpu.vendor}")
            else:
                why.append(f"{other.label}: less VRAM or listed later")
        self.hide_others(best, others)
        return best, f"{best.label}: {support_phrase(best.cell.level)}; preferred over " + "; ".join(why)

    def unidentified_nvidia(self, candidate: _Candidate) -> tuple[_Candidate, str]:
        """A working driver but a model name that fixes no generation (nvidia-smi truncates long
        names): plan CUDA from the driver alone, as "limited" until the generation is known."""
        candidate.cell = SupportCell(
            family="NVIDIA (unidentified)",
            os=self.os,
            level="limited",
            reason=f"the GPU generation could not be identified from {candidate.gpu.name!r}; "
            "planned from the driver alone",
            source="nvidia-smi driver version",
        )
        self.warn(
            f"Could not tell which NVIDIA generation {candidate.gpu.name!r} is; "
            "GPUs older than Turing need the cu126 build.",
            "Check with `nvidia-smi --query-gpu=name,compute_cap --format=csv`; for compute capability below 7.5 set "
            f"UNSLOTH_TORCH_INDEX_URL={self.pytorch}/cu126 and re-run `unsloth install`.",
        )
        return candidate, f"{candidate.label}: the only NVIDIA GPU, generation unknown"

    def hide_others(self, best: _Candidate, others: list[_Candidate]) -> None:
        """Same-vendor GPUs we did not choose would still be enumerated by the runtime: hide them."""
        same = [o for o in others if o.gpu.vendor == best.gpu.vendor]
        if not same or best.gpu.index is None or self.os == "windows" or self.os == "macos":
            return
        if all(o.cell and o.cell.level == best.cell.level and not o.gpu.integrated for o in same):
            return  # peers of the same kind: training may use them all
        if best.gpu.vendor == "nvidia":
            self.env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # make CUDA ordinals match nvidia-smi's
            self.env["CUDA_VISIBLE_DEVICES"] = str(best.gpu.index)
        elif best.gpu.vendor == "amd":
            self.env["HIP_VISIBLE_DEVICES"] = str(best.gpu.index)

    def host_fallback(self) -> tuple[Family, SupportCell]:
        """What runs without a usable GPU: MPS on Apple silicon, else the CPU."""
        apple = self.os == "macos" and (
            (self.platform.machine or "").lower() in ("arm64", "aarch64")
            or any(g.vendor == "apple" for g in self.platform.gpus)
        )
        family = self.matrix.families["Apple" if apple else "CPU"]
        return family, self.matrix.cell(family.name, self.os)

    def host_torch(self, family: Family) -> TorchChoice:
        if self.os == "macos":
            if family.name != "Apple":
                self.warn(
                    "PyTorch stopped publishing Intel-Mac (x86_64) wheels after 2.2.",
                    "Use an Apple-silicon Mac, Linux or Windows for training; GGUF chat still works here.",
                )
                return TorchChoice("cpu", None, self.matrix.urls["pypi"], "torch<2.3")
            return TorchChoice("mps", None, self.matrix.urls["pypi"], None)
        return TorchChoice("cpu", "cpu", f"{self.pytorch}/cpu", None)

    # --- torch ----------------------------------------------------------------------------------

    def torch_choice(self, chosen: _Candidate) -> TorchChoice | None:
        if chosen.cell.level == "unsupported":
            return None
        if chosen.gpu.vendor == "nvidia":
            return self.cuda_choice(chosen.gpu)
        if chosen.family and chosen.family.vendor == "amd":
            return self.amd_choice(chosen.gpu, chosen.family)
        if chosen.family and chosen.family.vendor == "apple":
            return self.host_torch(chosen.family)
        return None

    def cuda_choice(self, gpu: Gpu) -> TorchChoice | None:
        column = "linux" if self.os == "linux" else "windows"  # WSL reports the Windows host driver
        cc = _compute_capability(gpu)
        fitting = [index for index in self.matrix.cuda_indexes if cc is None or index.covers(cc)]
        if not fitting:
            lowest = min(index.sm[0] for index in self.matrix.cuda_indexes)
            self.warn(
                f"No PyTorch CUDA build covers compute capability {cc} ({gpu.name}); installing CPU PyTorch.",
                f"Train on a GPU of compute capability {lowest} or newer.",
            )
            return None
        driver = version_or_none(self.platform.nvidia_driver)
        if driver is None:
            index = fitting[0]
            self.warn(
                f"No NVIDIA driver was detected; the planned CUDA build ({index.variant}) needs one.",
                f"Install NVIDIA driver {index.driver[column]} or newer ({self.matrix.urls['nvidia_driver']}), "
                "then run `unsloth doctor`.",
                check="driver",
            )
            return self.cuda_torch(index)
        usable = [index for index in fitting if driver >= index.driver[column]]
        if not usable:
            oldest = min(index.driver[column] for index in fitting)
            self.warn(
                f"NVIDIA driver {self.platform.nvidia_driver} is too old for every PyTorch CUDA build for this GPU "
                f"(the minimum is {oldest} on {column}); installing CPU PyTorch instead.",
                f"Update the NVIDIA driver to {oldest} or newer ({self.matrix.urls['nvidia_driver']}), "
                "then re-run `unsloth install`.",
            )
            return None
        # Prefer a CUDA release the driver itself reports; minor-version compatibility runs the
        # newer 12.x builds on an older 12.x driver, but without newer PTX/JIT features.
        cuda_driver = version_or_none(self.platform.cuda_driver)
        native = [index for index in usable if cuda_driver is None or index.cuda <= cuda_driver]
        if native:
            index = native[0]
        else:
            index = usable[-1]
            self.warn(
                f"The driver reports CUDA {cuda_driver}, older than {index.variant}'s CUDA {index.cuda}; "
                "it runs through CUDA minor-version compatibility.",
                f"Update the NVIDIA driver to one that reports CUDA {index.cuda} or newer "
                f"({self.matrix.urls['nvidia_driver']}).",
            )
        return self.cuda_torch(index)

    def cuda_torch(self, index: CudaIndex) -> TorchChoice:
        self.cite(index.source)
        return TorchChoice("cuda", index.variant, f"{self.pytorch}/{index.variant}", _spec(index.torch))

    def amd_choice(self, gpu: Gpu, family: Family) -> TorchChoice | None:
        arch = gpu.arch
        if arch is None:
            return None
        if self.os == "windows":
            return self.amd_index_torch(family, arch)
        self.check_rocm_runtime()
        shipped = any(arch in index.archs for index in self.matrix.rocm_indexes)
        override = None if shipped else family.hsa_override.get(arch)  # run a shipped sibling's kernels
        target = gfx_of(override) if override else arch
        index = self.rocm_index(target)
        if index is None:
            return self.amd_index_torch(family, arch)
        if override:
            self.env["HSA_OVERRIDE_GFX_VERSION"] = override
            self.cite(family.source)
        self.effective_arch = target
        self.cite(index.source)
        return TorchChoice("rocm", index.variant, f"{self.pytorch}/{index.variant}", _spec(index.torch))

    def rocm_index(self, arch: str) -> RocmIndex | None:
        shipping = [index for index in self.matrix.rocm_indexes if arch in index.archs]
        if not shipping:
            return None
        host = version_or_none(self.platform.rocm_version)
        if host is None:
            return shipping[0]
        host = Version(f"{host.major}.{host.minor}")
        at_or_below = [index for index in shipping if index.rocm <= host]
        if at_or_below:
            return at_or_below[0]
        index = shipping[-1]  # the closest release above the host's ROCm
        self.warn(
            f"ROCm {self.platform.rocm_version} is older than every PyTorch ROCm build for {arch}; "
            f"using {index.variant}, which expects ROCm {index.rocm} or newer.",
            f"Upgrade ROCm to {index.rocm} or newer: {self.matrix.urls['rocm_install']}",
        )
        return index

    def amd_index_torch(self, family: Family, arch: str) -> TorchChoice | None:
        leaf = family.amd_index.get(arch)
        if leaf is None:
            self.warn(
                f"No PyTorch ROCm build ships {arch} on {self.os}; installing CPU PyTorch.",
                "See docs/hardware-support.md for the supported gfx targets; GGUF chat still runs through Vulkan.",
            )
            return None
        self.effective_arch = arch
        self.cite(self.matrix.sources["amd_wheels"])
        return TorchChoice("rocm", leaf, f"{self.amd}/{leaf}/", _spec(self.matrix.amd_torch))

    def check_rocm_runtime(self) -> None:
        """Linux/WSL ROCm wheels bundle their libraries but need the kernel side (and, on WSL, librocdxg)."""
        newest = self.matrix.rocm_indexes[0].rocm if self.matrix.rocm_indexes else None
        if self.os == "wsl":
            self.env.update(_env_rows(self.matrix, "rocm", "wsl", self.cite))
            if self.platform.dev_dxg is False:
                self.warn(
                    "/dev/dxg is missing: WSL has no GPU paravirtualization, so ROCm cannot see the GPU.",
                    "Install the current AMD Adrenalin driver on Windows, run `wsl --update`, then restart WSL.",
                    check="wsl-bridge",
                )
            if not self.rocm_present():
                self.warn(
                    "ROCm was not found inside WSL; ROCm on WSL needs ROCm and librocdxg.",
                    f"Install ROCm {newest} for WSL: {self.matrix.urls['rocm_wsl']}",
                    check="runtime",
                )
            return
        if not self.rocm_present():
            self.warn(
                "ROCm was not found. The PyTorch ROCm wheels bring their own ROCm libraries, but `rocminfo` "
                "and the amdgpu driver stack are needed to check the GPU.",
                f"Install ROCm {newest}: {self.matrix.urls['rocm_install']}",
            )
        if self.platform.dev_kfd is False:
            self.warn(
                "/dev/kfd is missing or not accessible: the amdgpu kernel driver is not loaded or you lack access.",
                "Install the amdgpu driver (amdgpu-install --usecase=rocm), "
                "then `sudo usermod -aG render,video $USER` and log in again.",
                check="dev-kfd",
            )

    def rocm_present(self) -> bool:
        """A ROCm version, or a ROCm tool that ran, shows ROCm is installed (even if its version is unknown)."""
        return self.platform.rocm_version is not None or any(
            self.platform.probes.get(name) == "ok" for name in ROCM_TOOLS
        )

    def apply_pins(self, torch: TorchChoice) -> TorchChoice:
        url = self.pins.torch_index_url
        if not url:
            return torch
        leaf = url.rstrip("/").rsplit("/", 1)[-1]
        backend = _backend_of_leaf(leaf) or torch.backend
        if backend != torch.backend:
            self.warn(
                f"UNSLOTH_TORCH_INDEX_URL pins a {backend} build, "
                f"but this machine's plan is {torch.backend} ({torch.variant}).",
                f"Unset UNSLOTH_TORCH_INDEX_URL to install the {torch.variant or torch.backend} build.",
            )
        return TorchChoice(backend, leaf, url, torch.version_spec if backend == torch.backend else None, torch.packages)

    def check_user_env(self, vendor: str | None) -> None:
        """An HSA override the user set makes ROCm load another GPU's kernels: say so, plan for the real GPU."""
        value = self.platform.hsa_override or self.platform.env.get("HSA_OVERRIDE_GFX_VERSION")
        if self.os == "windows":
            if value:
                self.warn(
                    f"HSA_OVERRIDE_GFX_VERSION={value} is set but has no effect on Windows.",
                    "Remove it from your user environment variables.",
                )
            return
        if vendor != "amd":
            return  # no AMD GPU to mislead
        if value is None:
            if self.platform.hsa_override_spoofs:  # detection saw the effect, not the variable
                spoofed = next((g for g in self.platform.gpus if g.reported_arch and g.reported_arch != g.arch), None)
                seen = (
                    f"reports {spoofed.reported_arch} for the real {spoofed.arch}" if spoofed else "reports another GPU"
                )
                self.warn(
                    f"The ROCm runtime {seen}: an HSA_OVERRIDE_GFX_VERSION is set somewhere (a service, "
                    "/etc/environment or a shell profile). The plan follows the real GPU.",
                    "Find and remove it: "
                    "grep -rs HSA_OVERRIDE_GFX_VERSION /etc/environment /etc/profile.d ~/.bashrc ~/.profile",
                    check="hsa-override",
                )
            return
        spoofs = self.platform.hsa_override_spoofs
        if value == self.env.get("HSA_OVERRIDE_GFX_VERSION"):
            return  # exactly the override the plan sets
        if spoofs is False or (spoofs is None and gfx_of(value) == self.effective_arch):
            return  # it names the GPU's own target: harmless
        self.warn(
            f"HSA_OVERRIDE_GFX_VERSION={value} makes ROCm report {gfx_of(value) or 'another GPU'} instead of the real "
            f"{self.effective_arch or 'GPU'}, which loads the wrong kernels (crashes, wrong results). "
            "The plan follows the real GPU.",
            "unset HSA_OVERRIDE_GFX_VERSION, and remove it from ~/.bashrc or ~/.profile",
            check="hsa-override",
        )

    # --- bitsandbytes, llama.cpp, fits ----------------------------------------------------------

    def bitsandbytes_choice(self, torch: TorchChoice, device: Gpu | None) -> dict[str, Any]:
        if device is not None:
            cc = _compute_capability(device) if torch.backend == "cuda" else None
            arch = self.effective_arch or device.arch
            for row in self.matrix.bitsandbytes:
                if row.backend != torch.backend or self.os not in row.oses:
                    continue
                if row.sm is not None and cc is not None and not row.sm[0] <= cc <= row.sm[1]:
                    continue
                if row.archs is not None and arch not in row.archs:
                    continue
                if torch.backend == "rocm" and (self.platform.machine or "x86_64").lower() not in ("x86_64", "amd64"):
                    continue  # bitsandbytes ships ROCm kernels for x86-64 only
                self.cite(row.source)
                return {"source": "pypi", "spec": row.spec, "note": None}
        note = "no bitsandbytes build for this device: QLoRA (4-bit) is unavailable, LoRA 16-bit works"
        return {"source": "none", "spec": None, "note": note}

    def llama_cpp_choice(self, torch: TorchChoice) -> dict[str, Any]:
        backend = _LLAMA_BACKEND.get(torch.backend, "cpu")
        if backend == "cpu" and self.os != "macos" and any(g.vendor != "apple" for g in self.platform.gpus):
            backend = "vulkan"  # a GPU we cannot train on can still run GGUF chat through Vulkan
        row = next((r for r in self.matrix.llama_cpp if r.backend == backend and self.os in r.oses), None)
        if row is None:
            row = next(r for r in self.matrix.llama_cpp if r.backend == "cpu")
        self.cite(row.source)
        arch = self.effective_arch or ""
        tag = row.wheel.get(torch.variant or "") or row.wheel.get(torch.backend) or row.wheel.get(backend)
        if tag and row.wheel_archs is not None and arch not in row.wheel_archs:
            tag = None  # the prebuilt wheel lacks this gfx target: build from source for it
        # "{arch}" names the gfx target; without one, drop that flag and let cmake build for the host's GPUs.
        cmake_args = (
            row.cmake_args.replace("{arch}", arch) if arch else re.sub(r"\s*\S*\{arch\}\S*", "", row.cmake_args)
        )
        return {
            "backend": row.backend,
            "how": "wheel" if tag else "source",
            "package": "llama-cpp-python",
            "index_url": f"{self.matrix.urls['llama_cpp_wheels'].rstrip('/')}/{tag}" if tag else None,
            "cmake_args": cmake_args,
        }

    def fits(self, device: Gpu | None, qlora: bool) -> dict[str, Any]:
        """Which model sizes fit: the documented formula in hardware_matrix.toml [fits]."""
        rule = self.matrix.fits
        memory, kind = (device.vram_bytes, "vram") if device else (self.platform.ram_bytes, "ram")
        if not memory:
            return {"memory": kind, "memory_gib": None, "qlora_max_b": None, "lora16_max_b": None, "table": []}

        def need_gib(params_b: float, bytes_per_param: float) -> float:
            return round(params_b * 1e9 * bytes_per_param * (1 + rule.overhead) / GIB + rule.fixed_gib, 1)

        gib = memory / GIB
        table = [
            {
                "params_b": size,
                "qlora_gib": need_gib(size, rule.qlora_bytes_per_param),
                "lora16_gib": need_gib(size, rule.lora16_bytes_per_param),
            }
            for size in rule.model_sizes_b
        ]
        return {
            "memory": kind,
            "memory_gib": round(gib, 1),
            "qlora_max_b": max((r["params_b"] for r in table if r["qlora_gib"] <= gib), default=None)
            if qlora
            else None,
            "lora16_max_b": max((r["params_b"] for r in table if r["lora16_gib"] <= gib), default=None),
            "table": table,
        }


# --- small pure helpers --------------------------------------------------------------------------


def version_or_none(text: str | None) -> Version | None:
    if not text:
        return None
    try:
        return Version(text)
    except InvalidVersion:
        return None


def _compute_capability(gpu: Gpu) -> Version | None:
    """ "8.9" from compute_capability, else from arch "sm_89" (the last digit is the minor)."""
    if gpu.compute_capability:
        return version_or_none(gpu.compute_capability)
    match = re.fullmatch(r"sm_(\d+)(\d)", gpu.arch or "")
    return Version(f"{match[1]}.{match[2]}") if match else None


def gfx_of(override: str) -> str | None:
    """HSA_OVERRIDE_GFX_VERSION "10.3.0" -> "gfx1030" (minor and stepping print as hex)."""
    match = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)", override.strip())
    if not match:
        return None
    major, minor, stepping = (int(part) for part in match.groups())
    return f"gfx{major}{minor:x}{stepping:x}"


def _backend_of_leaf(leaf: str) -> str | None:
    if re.fullmatch(r"cu\d+", leaf):
        return "cuda"
    if leaf.startswith(("rocm", "gfx")):
        return "rocm"
    if leaf == "cpu":
        return "cpu"
    if leaf == "xpu":
        return "xpu"
    return None


def _spec(specifier: str) -> str:
    return f"torch{specifier}"


def _env_rows(matrix: Matrix, backend: str, os_name: str, cite) -> dict[str, str]:
    env: dict[str, str] = {}
    for row in matrix.env:
        if row.backend == backend and os_name in row.oses:
            env.update(row.vars)
            cite(row.source)
    return env
