"""Platform x hardware matrix -> Plan: what to install and how, and how well it is supported. Pure."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from unsloth.platform.facts import Gpu, Platform


@dataclass
class Advice:
    """A warning the user should act on, with the exact fix."""

    message: str
    fix: str | None = None


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
    bitsandbytes: dict[str, Any]  # {"source": "pypi"|"index"|"none", "spec": ..., "note": ...}
    llama_cpp: dict[str, Any]  # {"backend": "cuda"|"hip"|"vulkan"|"metal"|"cpu", "cmake_args": ..., "how": ...}
    attention: str  # "sdpa" | "flash_attention_2" | "eager"
    env: dict[str, str]
    warnings: list[Advice] = field(default_factory=list)
    fits: dict[str, Any] = field(default_factory=dict)  # model sizes the VRAM fits, per method
    sources: list[str] = field(default_factory=list)  # the matrix rows' citations

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
