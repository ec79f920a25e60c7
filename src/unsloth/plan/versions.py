"""Small pure helpers on versions, names and index leaves."""

from __future__ import annotations

import re

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from unsloth.platform.facts import Gpu, Platform


def support_phrase(level: str) -> str:
    """A support level as prose: "full support", "limited support", "unsupported"."""
    return level if level == "unsupported" else f"{level} support"


def os_cell(platform: Platform) -> str:
    """The matrix OS column for a platform: WSL is its own column."""
    if platform.os == "linux" and platform.wsl:
        return "wsl"
    return platform.os or "linux"


def version_or_none(text: str | None) -> Version | None:
    if not text:
        return None
    try:
        return Version(text)
    except InvalidVersion:
        return None


def compute_capability(gpu: Gpu) -> Version | None:
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


def backend_of_leaf(leaf: str) -> str | None:
    """The torch backend an index leaf serves: "cu128" -> "cuda", "rocm6.4" -> "rocm"."""
    if re.fullmatch(r"cu\d+", leaf):
        return "cuda"
    if leaf.startswith(("rocm", "gfx")):
        return "rocm"
    if leaf == "cpu":
        return "cpu"
    if leaf == "xpu":
        return "xpu"
    return None


def torch_spec(specifier: str) -> str:
    return f"torch{specifier}"


NO_CEILING = Version("9999")


def torch_ceiling(specifier: str) -> Version:
    """The newest release a torch specifier (">=2.9,<2.14", "==2.11.0") reaches, as its tightest
    upper bound (an exact pin is its own bound)."""
    bounds = [Version(spec.version.removesuffix(".*")) for spec in SpecifierSet(specifier)
              if spec.operator in ("<", "<=", "==")]
    return min(bounds, default=NO_CEILING)
