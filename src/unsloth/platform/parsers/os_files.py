"""/proc/version and `uname -a` (kernel, WSL), /etc/os-release (distro), device-node presence."""

from __future__ import annotations

import re

from unsloth.platform.parsers import Findings, key_values

_MACHINES = r"\b(x86_64|aarch64|arm64|AMD64|i[3-6]86|armv7l|ppc64le|s390x|riscv64)\b"


def parse_kernel(text: str) -> Findings:
    found = Findings()
    if match := re.search(r"Linux version (\S+)", text):
        release = match.group(1)
    elif match := re.match(r"\s*Linux\s+\S+\s+(\S+)", text):
        release = match.group(1)
    elif re.match(r"\s*Darwin\b", text):
        found.facts.update(os="macos", wsl=False)
        return found
    elif re.match(r"\s*(MINGW|MSYS|CYGWIN)\w*_NT", text):
        found.facts.update(os="windows", wsl=False)
        return found
    else:
        return found
    found.facts.update(os="linux", kernel=release)
    if machine := re.search(_MACHINES, text):
        found.facts["machine"] = machine.group(1)
    # WSL1 kernels are '4.4.0-<build>-Microsoft'; WSL2 ones '...-microsoft-standard[-WSL2]'.
    if re.search(r"microsoft", text, re.I):
        found.facts.update(wsl=True, wsl_version=1 if re.search(r"^4\.4\.0-\d+-Microsoft$", release) else 2)
    else:
        found.facts["wsl"] = False
    return found


def parse_os_release(text: str) -> Findings:
    found = Findings()
    values = key_values(text, sep="=")
    name = values.get("pretty_name") or values.get("name")
    if name:
        found.facts.update(os="linux", distro=name.strip().strip("\"'"))
    return found


def parse_device_nodes(text: str) -> Findings:
    """'/dev/kfd: present' lines, as the device-nodes probe writes them."""
    found = Findings()
    values = key_values(text)
    for path, fact in (("/dev/kfd", "dev_kfd"), ("/dev/dxg", "dev_dxg"), ("/usr/lib/wsl", "_usr_lib_wsl")):
        if values.get(path) in ("present", "absent"):
            found.facts[fact] = values[path] == "present"
    if found.facts:
        found.facts["os"] = "linux"
    if found.facts.get("dev_dxg"):
        found.facts.update(wsl=True, wsl_version=2)  # /dev/dxg is the WSL2 GPU bridge
    return found
