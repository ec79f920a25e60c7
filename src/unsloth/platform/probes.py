"""Probes: each runs one tool or reads one file, with a timeout, and returns its raw text.

`PROBES` declares each probe once, with the parser of its text and what detection may take from
it; detection's orders derive from it. Running them is the only side effect in this package. Probes run concurrently, so detection takes about as
long as the slowest tool; a hung tool (nvidia-smi with a wedged driver) is killed, with its
children, when its time is up."""

from __future__ import annotations

import glob
import os
import platform as host_platform
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path

from unsloth.platform.dump import MAX_PROBE_BYTES, read_bounded
from unsloth.platform.facts import Platform, ProbeResult
from unsloth.platform.parsers import (
    Findings,
    amd_smi,
    drm,
    hipconfig,
    host,
    kfd,
    lspci,
    nvidia_driver_files,
    nvidia_smi,
    os_files,
    rocm_smi,
    rocm_version,
    rocminfo,
    system_profiler,
    win32,
)
from unsloth.platform.parsers.host import ENV_VARS

NVIDIA_QUERY = (
    "--query-gpu=index,name,pci.bus_id,pci.device_id,memory.total,compute_cap,driver_version,uuid",
    "--format=csv,noheader,nounits",
)
DISPLAY_CLASS_KEY = r"HKLM:\SYSTEM\ControlSet001\Control\Class\{4d36e968-e325-11ce-bfc1-08002be10318}"
_POWERSHELL = ("powershell", "-NoProfile", "-NonInteractive", "-Command")


@dataclass(frozen=True)
class Probe:
    """One probe, declared once: what it runs or reads, which parser reads its text, and what detection
    may take from it. Detection's orders (which probe is asked first for a fact, which lists GPUs
    best) are derived from these rows."""

    name: str  # also the dump file stem
    platforms: tuple[str, ...]  # sys.platform values it makes sense on
    command: tuple[str, ...] = ()  # a tool to run...
    read: Callable[[], str | None] | None = None  # ...or a function that reads files (None: absent)
    env: Callable[[], dict[str, str]] | None = None  # environment for the tool (default: ours)
    parser: Callable[[str], Findings] | None = None
    facts: Mapping[str, int] = field(default_factory=dict)  # Platform fact -> priority (1 is asked first)
    gpus: int | None = None  # lists GPUs, with this priority (1: the most detailed; its order is the report's)
    real_arch: int | None = None  # reads the physical AMD target, which an HSA override cannot change
    shows_rocm: bool = False  # answers only where ROCm is installed
    when: Callable[[], bool] | None = None  # run only when this holds


def _file(path: str) -> Callable[[], str | None]:
    def read() -> str | None:
        try:
            return read_bounded(Path(path))[:MAX_PROBE_BYTES].decode("utf-8", errors="replace")
        except FileNotFoundError:
            return None

    return read


# sysfs spreads one fact per file over many directories; these gather them into one dump file,
# with a '== <path> ==' line before each node or card.


def kfd_nodes(sys_root: str = "/sys") -> str | None:
    paths = sorted(glob.glob(f"{sys_root}/class/kfd/kfd/topology/nodes/*/properties"))
    return "\n".join(f"== {path} ==\n{_file(path)() or ''}" for path in paths) or None


def drm_cards(sys_root: str = "/sys") -> str | None:
    out = []
    for card in sorted(glob.glob(f"{sys_root}/class/drm/card*")):
        device = Path(card, "device")
        if not re.fullmatch(r"card\d+", Path(card).name) or not device.exists():
            continue  # connectors (card0-DP-1) and render nodes are not cards
        out += [f"== {device} ==", f"pci_address: {device.resolve().name}"]
        for name in ("vendor", "device", "class", "boot_vga", "mem_info_vram_total"):
            if (text := _file(f"{device}/{name}")()) is not None:
                out.append(f"{name}: {text.strip()}")
    return "\n".join(out) or None


def _device_nodes() -> str:
    return "\n".join(
        f"{path}: {'present' if os.path.exists(path) else 'absent'}"
        for path in ("/dev/kfd", "/dev/dxg", "/usr/lib/wsl")
    )


def _host() -> str:
    import psutil

    cpu = host_platform.processor()
    cpuinfo = _file("/proc/cpuinfo")() or ""
    for line in cpuinfo.splitlines():
        if line.startswith("model name"):
            cpu = line.partition(":")[2].strip()
            break
    return "\n".join(
        [
            f"sys.platform: {sys.platform}",
            f"machine: {host_platform.machine()}",
            f"cpu: {cpu}",
            f"ram_bytes: {psutil.virtual_memory().total}",
        ]
    )


def _env() -> str:
    return "\n".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if ENV_VARS.fullmatch(k))


def _without_override() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("HSA_OVERRIDE_GFX_VERSION")}


LINUX, WINDOWS, MAC = ("linux",), ("win32", "cygwin"), ("darwin",)
ALL = LINUX + WINDOWS + MAC

def _hsa_override_set() -> bool:
    return any(k.startswith("HSA_OVERRIDE_GFX_VERSION") for k in os.environ)


OS = "os"
PROBES: tuple[Probe, ...] = (
    Probe("host", ALL, read=_host, parser=host.parse_host, facts={OS: 1, "machine": 1, "cpu": 1, "ram_bytes": 1}),
    Probe("env", ALL, read=_env, parser=host.parse_env, facts={"wsl": 4, "env": 1, "hsa_override": 1}),
    Probe("nvidia-smi", LINUX + WINDOWS, ("nvidia-smi",), parser=nvidia_smi.parse,
          facts={OS: 9, "wsl": 5, "nvidia_driver": 2, "cuda_driver": 1}, gpus=2),
    Probe("nvidia-smi-query", LINUX + WINDOWS, ("nvidia-smi", *NVIDIA_QUERY), parser=nvidia_smi.parse,
          facts={OS: 10, "wsl": 6, "nvidia_driver": 1, "cuda_driver": 2}, gpus=1),
    Probe("proc-driver-nvidia-version", LINUX, read=_file("/proc/driver/nvidia/version"),
          parser=nvidia_driver_files.parse, facts={OS: 21, "nvidia_driver": 4}),
    Probe("sys-module-nvidia-version", LINUX, read=_file("/sys/module/nvidia/version"),
          parser=nvidia_driver_files.parse, facts={OS: 22, "nvidia_driver": 3}),
    Probe("rocminfo", LINUX, ("rocminfo",), parser=rocminfo.parse, facts={OS: 11}, gpus=3, shows_rocm=True),
    # With an HSA override set, rocminfo reports the spoofed target; run it again without.
    Probe("rocminfo-no-override", LINUX, ("rocminfo",), env=_without_override, parser=rocminfo.parse, gpus=4,
          real_arch=2, shows_rocm=True, when=_hsa_override_set),
    Probe("rocm-smi", LINUX, ("rocm-smi", "--showproductname", "--showid", "--showbus", "--showmeminfo", "vram"),
          parser=rocm_smi.parse, facts={OS: 12}, gpus=8, real_arch=6, shows_rocm=True),
    Probe(
        "rocm-smi-json",
        LINUX,
        ("rocm-smi", "--showproductname", "--showid", "--showbus", "--showmeminfo", "vram", "--json"),
        parser=rocm_smi.parse, facts={OS: 13}, gpus=7, real_arch=5, shows_rocm=True,
    ),
    Probe("amd-smi", LINUX, ("amd-smi", "static"), parser=amd_smi.parse, facts={OS: 14, "rocm_version": 3}, gpus=5,
          real_arch=3, shows_rocm=True),
    Probe("amd-smi-list", LINUX, ("amd-smi", "list"), parser=amd_smi.parse, gpus=6, real_arch=4, shows_rocm=True),
    Probe("amd-smi-version", LINUX, ("amd-smi", "version"), parser=amd_smi.parse, facts={OS: 15, "rocm_version": 2},
          shows_rocm=True),
    Probe("hipconfig", LINUX + WINDOWS, ("hipconfig", "--version"), parser=hipconfig.parse,
          facts={OS: 16, "rocm_version": 4}, shows_rocm=True),
    Probe("rocm-version", LINUX, read=_file("/opt/rocm/.info/version"), parser=rocm_version.parse,
          facts={OS: 17, "rocm_version": 1}, shows_rocm=True),
    Probe("kfd-topology", LINUX, read=kfd_nodes, parser=kfd.parse, facts={OS: 18}, gpus=9, real_arch=1),
    Probe("drm", LINUX, read=drm_cards, parser=drm.parse, facts={OS: 19}, gpus=10),
    Probe("lspci", LINUX, ("lspci", "-D", "-nn"), parser=lspci.parse, facts={OS: 20}, gpus=11),
    Probe("proc-version", LINUX, read=_file("/proc/version"), parser=os_files.parse_kernel,
          facts={OS: 2, "wsl": 1, "wsl_version": 1, "kernel": 1, "machine": 3}),
    Probe("uname", LINUX + MAC, ("uname", "-a"), parser=os_files.parse_kernel,
          facts={OS: 3, "wsl": 2, "wsl_version": 2, "kernel": 2, "machine": 2}),
    Probe("os-release", LINUX, read=_file("/etc/os-release"), parser=os_files.parse_os_release,
          facts={OS: 4, "distro": 1}),
    Probe("device-nodes", LINUX, read=_device_nodes, parser=os_files.parse_device_nodes,
          facts={OS: 5, "wsl": 3, "wsl_version": 3, "dev_kfd": 1, "dev_dxg": 1}),
    Probe(
        "win32-videocontroller",
        WINDOWS,
        (
            *_POWERSHELL,
            "Get-CimInstance Win32_VideoController | Format-List Name,AdapterCompatibility,VideoProcessor,"
            "AdapterRAM,PNPDeviceID,DriverVersion",
        ),
        parser=win32.parse, facts={OS: 6, "wsl": 7}, gpus=12,
    ),
    Probe(
        "win-registry-video",
        WINDOWS,
        (
            *_POWERSHELL,
            f"Get-ItemProperty -ErrorAction SilentlyContinue '{DISPLAY_CLASS_KEY}\\0*' | "
            "Format-List DriverDesc,'HardwareInformation.qwMemorySize'",
        ),
        parser=win32.parse_registry, facts={OS: 7, "wsl": 8},
    ),
    Probe("system-profiler", MAC, ("system_profiler", "SPDisplaysDataType"), parser=system_profiler.parse,
          facts={OS: 8, "wsl": 9}, gpus=13),
)


# --- what detection derives from the rows ---------------------------------------------------------


def _by(priority: Callable[[Probe], int | None]) -> tuple[str, ...]:
    return tuple(p.name for p in sorted((p for p in PROBES if priority(p) is not None), key=priority))


def sources_of(fact: str) -> tuple[str, ...]:
    """The probes that state ``fact``, the one to believe first."""
    return _by(lambda p: p.facts.get(fact))


PARSERS: dict[str, Callable[[str], Findings]] = {p.name: p.parser for p in PROBES if p.parser is not None}
# Probes that list GPUs, most detailed first: GPUs are reported in the order the first of these that
# saw them lists them; later probes fill in what earlier ones left unknown.
GPU_SOURCES = _by(lambda p: p.gpus)
# Where the physical AMD target comes from: KFD sysfs and tools that read it; rocminfo (the HSA
# runtime) reports the override.
REAL_ARCH_SOURCES = _by(lambda p: p.real_arch)
# rocm_version is the highest any of these states, not the first.
ROCM_VERSION_SOURCES = sources_of("rocm_version")
# Platform facts, in the Platform's own order: the first probe in each that states the fact wins.
FACT_SOURCES = {
    f.name: sources_of(f.name) for f in fields(Platform) if f.name != "rocm_version" and sources_of(f.name)
}
ROCM_PROBES = tuple(p.name for p in PROBES if p.shows_rocm)


def run_probe(probe: Probe, timeout: float) -> ProbeResult:
    if probe.read is not None:
        try:
            text = probe.read()
        except OSError as exc:
            return ProbeResult(probe.name, "failed", detail=f"{type(exc).__name__}: {exc}")
        return ProbeResult(probe.name, "absent") if text is None else ProbeResult(probe.name, "ok", text)
    return run_command(probe.name, probe.command, timeout, probe.env() if probe.env else None)


def run_command(name: str, command: tuple[str, ...], timeout: float, env: dict[str, str] | None = None) -> ProbeResult:
    executable = shutil.which(command[0])
    line = " ".join(command)
    if executable is None:
        return ProbeResult(name, "absent", detail=f"{command[0]} not found on PATH")
    # Its own session (POSIX), so a timeout kills the tool and anything it started with it.
    group = {"creationflags": subprocess.CREATE_NEW_PROCESS_GROUP} if os.name == "nt" else {"start_new_session": True}
    try:
        process = subprocess.Popen(
            [executable, *command[1:]],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            **group,
        )
    except OSError as exc:
        return ProbeResult(name, "failed", detail=f"{line}: {exc}")
    try:
        out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(process)
        return ProbeResult(name, "timeout", detail=f"{line}: no answer within {timeout:g} s")
    text = out[:MAX_PROBE_BYTES].decode("utf-8", errors="replace")
    if process.returncode != 0:
        return ProbeResult(name, "failed", text, detail=f"{line}: exit code {process.returncode}")
    return ProbeResult(name, "ok", text, detail=line)


def _kill(process: subprocess.Popen[bytes]) -> None:
    try:
        if os.name == "nt":
            process.kill()
        else:
            os.killpg(process.pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        process.communicate(timeout=5)
    except subprocess.TimeoutExpired:  # a grandchild still holds the pipe (Windows kills only the child)
        pass


def run_probes(timeout: float = 5.0, platform: str = sys.platform) -> dict[str, ProbeResult]:
    """Run every probe that makes sense on this OS, concurrently; probe name -> result."""
    probes = [p for p in PROBES if platform in p.platforms and (p.when is None or p.when())]
    with ThreadPoolExecutor(max_workers=len(probes)) as pool:
        results = list(pool.map(lambda probe: run_probe(probe, timeout), probes))
    return {result.name: result for result in results}
