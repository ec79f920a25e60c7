"""What a plan is made of, and the values its steps hand each other. Pure data."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, TypeVar

from unsloth.matrix import Matrix
from unsloth.platform.facts import Gpu, Platform


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


_Part = TypeVar("_Part", bound="_FlatJson")


class _FlatJson:
    """A plan part whose JSON is its fields, as they are."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls: type[_Part], data: Mapping[str, Any]) -> _Part:
        return cls(**data)


@dataclass
class BitsAndBytes(_FlatJson):
    """bitsandbytes (QLoRA's 4-bit kernels), where a build exists for the device."""

    source: str  # "pypi" | "none"
    spec: str | None = None  # "bitsandbytes>=0.46"
    note: str | None = None  # why there is none

    @property
    def available(self) -> bool:
        return self.source != "none"


@dataclass
class LlamaCpp(_FlatJson):
    """llama-cpp-python (GGUF chat): a prebuilt wheel from `index_url`, or built with `cmake_args`."""

    backend: str  # "cuda" | "hip" | "vulkan" | "metal" | "cpu"
    how: str = "source"  # "wheel" | "source"
    package: str = "llama-cpp-python"
    index_url: str | None = None
    cmake_args: str = ""


@dataclass
class FlashLinearAttention(_FlatJson):
    """flash-linear-attention (Triton kernels for Qwen3.5's Gated DeltaNet layers), where they run and
    help; else none, with why: our torch chunked rule runs those layers then."""

    source: str  # "pypi" | "none"
    spec: str | None = None  # "flash-linear-attention==0.6.0"
    note: str = ""  # why there is none (and the fix), or what stays on the torch path
    triton: str | None = None  # the Triton the plan's torch pins ("3.7.1"); None: unknown
    broken_triton: str | None = None  # Tritons that break it on this GPU (">=3.4.0,<3.7.1"): doctor checks

    @property
    def available(self) -> bool:
        return self.source != "none"


@dataclass
class Vllm(_FlatJson):
    """vLLM (GRPO rollouts for fast_inference=True), in a plan only when `--with vllm` asked for it:
    its PyPI wheel where one exists for this machine, else refused, with the reason."""

    source: str  # "pypi" | "none" (refused)
    spec: str | None = None  # "vllm==0.32.0"
    torch: str | None = None  # the exact torch it was built against, which the plan then installs: "torch==2.13.0"
    python: str | None = None  # the Pythons its wheels install on: ">=3.11,<3.15"
    note: str = ""  # what it changed in the plan, or why it is refused and what still works

    @property
    def available(self) -> bool:
        return self.source != "none"


@dataclass
class FitRow:
    params_b: float  # model size, billions of parameters
    qlora_gib: float  # memory QLoRA needs for it
    lora16_gib: float  # memory 16-bit LoRA needs for it


@dataclass
class Fits:
    """Which model sizes fit in the memory training runs in (hardware_matrix.toml [fits])."""

    memory: str  # "vram" | "ram"
    memory_gib: float | None = None  # None: the size is unknown
    qlora_max_b: float | None = None  # None without bitsandbytes
    lora16_max_b: float | None = None
    table: list[FitRow] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Fits:
        return cls(**{**data, "table": [FitRow(**row) for row in data.get("table", [])]})


@dataclass
class Plan:
    support: str  # "full" | "limited" | "unsupported"
    reason: str
    device: Gpu | None  # the compute device chosen, None for CPU
    device_reason: str
    torch: TorchChoice
    bitsandbytes: BitsAndBytes
    llama_cpp: LlamaCpp
    attention: str  # "sdpa" | "flash_attention_2" | "eager"
    env: dict[str, str]
    warnings: list[Advice] = field(default_factory=list)
    fits: Fits | None = None  # model sizes the memory fits, per method
    sources: list[str] = field(default_factory=list)  # the matrix rows' citations
    os: str | None = None  # the matrix OS cell: "linux" | "wsl" | "windows" | "macos"
    family: str | None = None  # the matrix family planned for ("RDNA3", "Ada", "CPU", ...)
    vllm: Vllm | None = None  # None: not asked for (`--with vllm`), and then absent from the JSON
    # None: the matrix has no flash_linear_attention rows (an older or trimmed copy), absent from the JSON
    flash_linear_attention: FlashLinearAttention | None = None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for part in ("vllm", "flash_linear_attention"):
            if data[part] is None:
                del data[part]  # a plan without them reads as it always did
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Plan:
        """A plan as `to_json` wrote it (a receipt's, or `unsloth install --dry-run --json`)."""
        return cls(**{
            **data,
            "device": Gpu(**data["device"]) if data.get("device") else None,
            "torch": TorchChoice(**data["torch"]),
            "bitsandbytes": BitsAndBytes.from_json(data["bitsandbytes"]),
            "llama_cpp": LlamaCpp.from_json(data["llama_cpp"]),
            "warnings": [Advice(**advice) for advice in data.get("warnings", [])],
            "fits": Fits.from_json(data["fits"]) if data.get("fits") else None,
            "vllm": Vllm.from_json(data["vllm"]) if data.get("vllm") else None,
            "flash_linear_attention": (FlashLinearAttention.from_json(data["flash_linear_attention"])
                                       if data.get("flash_linear_attention") else None),
        })


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


@dataclass(frozen=True)
class Inputs:
    """What every step reads and none changes: the machine, the matrix, and where wheels come from."""

    platform: Platform
    matrix: Matrix
    pins: Overrides
    os: str  # the matrix OS column (os_cell)
    pytorch: str  # PyTorch's wheel root, or the user's mirror of it
    amd: str  # AMD's wheel root, or the user's mirror of it


@dataclass(frozen=True)
class Notes:
    """What a step has to say beside its value: warnings in the order they arose, and the matrix rows
    it relied on (each cited once, in first-cited order). Steps return them; `+` joins them."""

    warnings: tuple[Advice, ...] = ()
    sources: tuple[str, ...] = ()

    def __add__(self, other: Notes) -> Notes:
        return Notes(self.warnings + other.warnings,
                     self.sources + tuple(s for s in dict.fromkeys(other.sources) if s not in self.sources))

    def warn(self, message: str, fix: str | None = None, check: str | None = None) -> Notes:
        return self + Notes(warnings=(Advice(message, fix, check),))

    def cite(self, *sources: str) -> Notes:
        return self + Notes(sources=sources)


NO_NOTES = Notes()
