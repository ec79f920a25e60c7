"""Probes: each runs one tool or reads one file, with a timeout, and returns its raw text.

The only module here with side effects. Probes run concurrently, so detection takes about as
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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from unsloth.platform.dump import MAX_PROBE_BYTES, read_bounded
from unsloth.platform.facts import ProbeResult
from unsloth.platform.parsers.host import ENV_VARS

NVIDIA_QUERY = (
    "--query-gpu=index,name,pci.bus_id,pci.device_id,memory.total,compute_cap,driver_version,uuid",
    "--format=csv,noheader,nounits",
)
DISPLAY_CLASS_KEY = r"HKLM:\SYSTEM\ControlSet001\Control\Class\{4d36e968-e325-11ce-bfc1-08002be10318}"
_POWERSHELL = ("powershell", "-NoProfile", "-NonInteractive", "-Command")


@dataclass(frozen=True)
class Probe:
    name: str  # also the dump file stem
    platforms: tuple[str, ...]  # sys.platform values it makes sense on
    command: tuple[str, ...] = ()  # a tool to run...
    read: Callable[[], str | None] | None = None  # ...or a function that reads files (None: absent)
    env: Callable[[], dict[str, str]] | None = None  # environment for the tool (default: ours)


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

PROBES: tuple[Probe, ...] = (
    Probe("host", ALL, read=_host),
    Probe("env", ALL, read=_env),
    Probe("nvidia-smi", LINUX + WINDOWS, ("nvidia-smi",)),
    Probe("nvidia-smi-query", LINUX + WINDOWS, ("nvidia-smi", *NVIDIA_QUERY)),
    Probe("proc-driver-nvidia-version", LINUX, read=_file("/proc/driver/nvidia/version")),
    Probe("sys-module-nvidia-version", LINUX, read=_file("/sys/module/nvidia/version")),
    Probe("rocminfo", LINUX, ("rocminfo",)),
    Probe("rocm-smi", LINUX, ("rocm-smi", "--showproductname", "--showid", "--showbus", "--showmeminfo", "vram")),
    Probe(
        "rocm-smi-json",
        LINUX,
        ("rocm-smi", "--showproductname", "--showid", "--showbus", "--showmeminfo", "vram", "--json"),
    ),
    Probe("amd-smi", LINUX, ("amd-smi", "static")),
    Probe("amd-smi-list", LINUX, ("amd-smi", "list")),
    Probe("amd-smi-version", LINUX, ("amd-smi", "version")),
    Probe("hipconfig", LINUX + WINDOWS, ("hipconfig", "--version")),
    Probe("rocm-version", LINUX, read=_file("/opt/rocm/.info/version")),
    Probe("kfd-topology", LINUX, read=kfd_nodes),
    Probe("drm", LINUX, read=drm_cards),
    Probe("lspci", LINUX, ("lspci", "-D", "-nn")),
    Probe("proc-version", LINUX, read=_file("/proc/version")),
    Probe("uname", LINUX + MAC, ("uname", "-a")),
    Probe("os-release", LINUX, read=_file("/etc/os-release")),
    Probe("device-nodes", LINUX, read=_device_nodes),
    Probe(
        "win32-videocontroller",
        WINDOWS,
        (
            *_POWERSHELL,
            "Get-CimInstance Win32_VideoController | Format-List Name,AdapterCompatibility,VideoProcessor,"
            "AdapterRAM,PNPDeviceID,DriverVersion",
        ),
    ),
    Probe(
        "win-registry-video",
        WINDOWS,
        (
            *_POWERSHELL,
            f"Get-ItemProperty -ErrorAction SilentlyContinue '{DISPLAY_CLASS_KEY}\\0*' | "
            "Format-List DriverDesc,'HardwareInformation.qwMemorySize'",
        ),
    ),
    Probe("system-profiler", MAC, ("system_profiler", "SPDisplaysDataType")),
)


def _override_probe() -> Probe | None:
    """With an HSA override set, rocminfo reports the spoofed target; run it again without."""
    if any(k.startswith("HSA_OVERRIDE_GFX_VERSION") for k in os.environ):
        return Probe("rocminfo-no-override", LINUX, ("rocminfo",), env=_without_override)
    return None


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
    probes = [p for p in (*PROBES, _override_probe()) if p is not None and platform in p.platforms]
    with ThreadPoolExecutor(max_workers=len(probes)) as pool:
        results = list(pool.map(lambda probe: run_probe(probe, timeout), probes))
    return {result.name: result for result in results}
