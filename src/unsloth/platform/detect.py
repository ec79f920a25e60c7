"""Merge what every probe showed into one Platform, recording which probe said what. Pure at the
core (``detect``); ``detect_live`` and ``detect_from_dump`` add the probing or the dump reading.

The same GPU seen by several tools (nvidia-smi table and csv; rocminfo, KFD, lspci) is merged by
PCI bus id, then uuid, then by order among GPUs of the same vendor whose ids do not disagree."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

from unsloth.platform import identification as ident
from unsloth.platform.facts import Gpu, Platform, ProbeResult
from unsloth.platform.parsers import Findings, parser_for, unquote
from unsloth.platform.probes import (  # detection's orders, derived from the one table of probes
    FACT_SOURCES,
    GPU_SOURCES,
    REAL_ARCH_SOURCES,
    ROCM_PROBES,
    ROCM_VERSION_SOURCES,
)

# More GPUs than any one host holds is not a machine but text misread as one: such a probe's GPUs
# are dropped (and merging stays cheap: it compares every GPU with every other).
MAX_GPUS_PER_PROBE = 64
_GPU_FIELDS = (
    "name", "pci_id", "bus_id", "uuid", "vram_bytes", "compute_capability", "integrated", "chip", "family", "kfd_node"
)


def detect(results: dict[str, ProbeResult]) -> Platform:
    platform = Platform(probes={name: result.status for name, result in sorted(results.items())})
    findings: dict[str, Findings] = {}
    for name, result in results.items():
        parser = parser_for(name)
        if parser is None or not result.text:
            continue
        try:
            found = parser(unquote(result.text))
        except Exception as exc:  # a parser bug must not cost the other probes' facts
            platform.notes.append(f"{name}: could not be read ({type(exc).__name__}: {exc})")
            continue
        if len(found.gpus) > MAX_GPUS_PER_PROBE:
            platform.notes.append(f"{name}: {len(found.gpus)} GPUs is no real machine's output; its GPUs are ignored")
            found.gpus = []
        findings[name] = found
    _platform_facts(platform, findings)
    platform.gpus = _merge_gpus(findings, platform)
    _apply_registry_memory(platform, findings)
    for gpu in platform.gpus:
        _identify(gpu, platform)
    if any(gpu.reported_arch and gpu.arch and gpu.reported_arch != gpu.arch for gpu in platform.gpus):
        platform.hsa_override_spoofs = True
    elif platform.hsa_override is not None and any(g.vendor == "amd" and g.arch for g in platform.gpus):
        platform.hsa_override_spoofs = False
    return platform


def detect_live(timeout: float = 5.0) -> tuple[Platform, dict[str, ProbeResult]]:
    from unsloth.platform.probes import run_probes

    results = run_probes(timeout=timeout)
    return detect(results), results


def detect_from_dump(directory: str | Path) -> tuple[Platform, dict[str, ProbeResult]]:
    from unsloth.platform.dump import read_dump

    results = read_dump(directory)
    return detect(results), results


def _platform_facts(platform: Platform, findings: dict[str, Findings]) -> None:
    for fact, sources in FACT_SOURCES.items():
        said = [(s, findings[s].facts[fact]) for s in sources if s in findings and fact in findings[s].facts]
        if not said:
            continue
        # None is a probe saying "unknown" (CUDA Version: ERR!): a later probe's value still counts.
        source, value = next(((s, v) for s, v in said if v is not None), said[0])
        setattr(platform, fact, value)
        platform.provenance[fact] = source
        others = {f"{s}={v}" for s, v in said if v != value and v is not None}
        if others and fact != "env":
            platform.notes.append(f"{fact}: {source} says {value}; also {', '.join(sorted(others))}")
    if platform.os in ("windows", "macos"):
        platform.wsl = False
    elif platform.wsl is None and platform.os == "linux":
        if any(f.facts.get("_usr_lib_wsl") for f in findings.values()):
            platform.wsl, platform.provenance["wsl"] = True, "device-nodes"
    if not platform.wsl:
        platform.wsl_version = None
    _rocm_version(platform, findings)
    _rocm_installed(platform)
    for name, found in sorted(findings.items()):
        if error := found.facts.get("_error"):
            platform.notes.append(f"{name} failed: {error}")


def _rocm_installed(platform: Platform) -> None:
    """True when a probe that answers only where ROCm is installed answered; False when such probes
    ran and none did; None when none ran (another OS, a partial dump)."""
    ran = [name for name in ROCM_PROBES if name in platform.probes]
    if ran:
        answered = next((name for name in ran if platform.probes[name] == "ok"), None)
        platform.rocm_installed = answered is not None
        if answered:
            platform.provenance["rocm_installed"] = answered


def _rocm_version(platform: Platform, findings: dict[str, Findings]) -> None:
    said = []
    for source in ROCM_VERSION_SOURCES:
        value = findings.get(source, Findings()).facts.get("rocm_version")
        try:
            said.append((Version(value), value, source))
        except (InvalidVersion, TypeError):
            continue
    if not said:
        return
    best = max(said, key=lambda item: item[0])
    platform.rocm_version, platform.provenance["rocm_version"] = best[1], best[2]
    if len({v.release[:2] for v, _, _ in said}) > 1:
        listed = ", ".join(f"{s}={text}" for _, text, s in said)
        platform.notes.append(f"rocm_version: installs disagree ({listed}); reporting the highest")


class _Seen:
    """One physical GPU and every probe's view of it."""

    def __init__(self, source: str, gpu: Gpu):
        self.views: list[tuple[str, Gpu]] = [(source, gpu)]

    @property
    def vendor(self) -> str:
        return self.views[0][1].vendor

    def first(self, field: str, sources: tuple[str, ...] | None = None) -> tuple[str | None, Any]:
        """The first value a view gives for ``field``, and its probe; with ``sources``, only
        those probes' views, in that order."""
        views = self.views if sources is None else [v for s in sources for v in self.views if v[0] == s]
        for source, gpu in views:
            if (value := getattr(gpu, field)) is not None:
                return source, value
        return None, None

    def matches(self, gpu: Gpu) -> str | None:
        """'bus'/'uuid' for an identity match, 'order' when nothing disagrees, None on conflict."""
        if gpu.vendor != self.vendor:
            return None
        bus, uuid, pci = self.first("bus_id")[1], self.first("uuid")[1], self.first("pci_id")[1]
        if bus and gpu.bus_id:
            return "bus" if bus == gpu.bus_id else None
        if uuid and gpu.uuid and uuid.startswith("GPU-") == gpu.uuid.startswith("GPU-"):
            return "uuid" if uuid == gpu.uuid else None
        if pci and gpu.pci_id and pci != gpu.pci_id:
            return None
        return "order"


def _merge_gpus(findings: dict[str, Findings], platform: Platform) -> list[Gpu]:
    seen: list[_Seen] = []
    for source in GPU_SOURCES:
        if source not in findings:
            continue
        claimed: set[int] = set()
        for gpu in findings[source].gpus:
            match = None
            for kind in ("bus", "uuid", "order"):
                match = next((i for i, s in enumerate(seen) if i not in claimed and s.matches(gpu) == kind), None)
                if match is not None:
                    break
            if match is None:
                seen.append(_Seen(source, gpu))
                claimed.add(len(seen) - 1)
            else:
                seen[match].views.append((source, gpu))
                claimed.add(match)
    return [_resolve(s, platform) for s in seen]


def _resolve(seen: _Seen, platform: Platform) -> Gpu:
    gpu = Gpu(vendor=seen.vendor, index=seen.views[0][1].index)
    gpu.sources = list(dict.fromkeys(source for source, _ in seen.views))
    for field in _GPU_FIELDS:
        setattr(gpu, field, seen.first(field)[1])
    if gpu.vendor == "amd":
        _amd_arch(gpu, seen, platform)
    return gpu


def _amd_arch(gpu: Gpu, seen: _Seen, platform: Platform) -> None:
    real_source, real = seen.first("arch", REAL_ARCH_SOURCES)
    runtime = seen.first("arch", ("rocminfo",))[1]
    table = (ident.amd_by_pci(gpu.pci_id) or {}).get("gfx") or ident.amd_gfx_by_codename(gpu.chip)
    if real is None and table is not None:
        real, real_source = table, "pci id"
    overridden = platform.hsa_override is not None or any(
        k.startswith("HSA_OVERRIDE_GFX_VERSION") for k in platform.env
    )
    if real is None and not overridden:
        real = runtime  # no override set: what the runtime reports is the hardware
    gpu.arch = real
    if runtime is not None and (runtime != real or overridden):
        gpu.reported_arch = runtime
    if runtime and real and runtime != real:
        platform.notes.append(
            f"GPU {gpu.index} ({gpu.name or gpu.pci_id}): the ROCm runtime reports {runtime} but the "
            f"hardware is {real} (from {real_source}): HSA_OVERRIDE_GFX_VERSION is spoofing it"
        )


def _identify(gpu: Gpu, platform: Platform) -> None:
    """Fill in what the identification tables fix from the ids and names the probes printed."""
    if gpu.vendor == "amd":
        row = ident.amd_by_pci(gpu.pci_id) or {}
        gpu.chip = gpu.chip or row.get("chip")
        gpu.name = gpu.name or row.get("name")
        gpu.family = ident.amd_family(gpu.arch) or gpu.family or ident.amd_legacy_family(gpu.name, gpu.chip)
        if gpu.integrated is None:
            gpu.integrated = row.get("integrated", ident.integrated_by_name("amd", gpu.name))
    elif gpu.vendor == "nvidia":
        by_name = ident.nvidia_by_name(gpu.name) or {}
        gpu.compute_capability = gpu.compute_capability or ident.nvidia_cc_by_pci(gpu.pci_id) or by_name.get("cc")
        gpu.arch = ident.nvidia_sm(gpu.compute_capability)
        gpu.family = ident.nvidia_family(gpu.compute_capability) or gpu.family
        if gpu.integrated is None:
            branded = re.search(r"GeForce|Quadro|Tesla|TITAN|\bRTX\b|NVIDIA [A-Z]\d", gpu.name or "")
            gpu.integrated = by_name.get("integrated", False) if (by_name or branded) else None
    elif gpu.vendor == "intel":
        gpu.family = gpu.family or ident.intel_family(gpu.pci_id, gpu.name)
        if gpu.integrated is None:
            gpu.integrated = ident.integrated_by_name("intel", gpu.name)
    elif gpu.vendor == "apple":
        gpu.integrated = True
    if gpu.integrated:
        gpu.vram_bytes = None  # an integrated GPU's "VRAM" is a carve-out of system RAM (see ram_bytes)


def _apply_registry_memory(platform: Platform, findings: dict[str, Findings]) -> None:
    """Windows: give each adapter whose size no tool printed its registry qwMemorySize, matched by
    name, else by order."""
    memory = findings.get("win-registry-video", Findings()).facts.get("_registry_memory") or []
    windows_gpus = [g for g in platform.gpus if "win32-videocontroller" in g.sources]
    unmatched = list(memory)
    for gpu in windows_gpus:
        pick = next((m for m in unmatched if m[0] and gpu.name and m[0].strip() == gpu.name.strip()), None)
        if pick is None and unmatched and all(m[0] is None for m in unmatched) and len(memory) == len(windows_gpus):
            pick = unmatched[0]
        if pick is not None:
            unmatched.remove(pick)
            if gpu.vram_bytes is None:
                gpu.vram_bytes = pick[1]
                gpu.sources.append("win-registry-video")
