"""The host probe's own 'key: value' report (sys.platform, machine, CPU, RAM) and the env probe's
'NAME=value' lines."""

from __future__ import annotations

import re

from unsloth.platform.parsers import Findings, key_values, to_int

_OS = {"linux": "linux", "win32": "windows", "cygwin": "windows", "darwin": "macos"}
# Variables that change which GPUs the runtimes see, or what they report.
ENV_VARS = re.compile(
    r"HSA_OVERRIDE_GFX_VERSION(_\d+)?|CUDA_VISIBLE_DEVICES|HIP_VISIBLE_DEVICES|ROCR_VISIBLE_DEVICES|"
    r"GPU_DEVICE_ORDINAL|HSA_ENABLE_DXG_DETECTION|WSL_DISTRO_NAME|WSL_INTEROP|CUDA_DEVICE_ORDER"
)


def parse_host(text: str) -> Findings:
    found = Findings()
    values = key_values(text)
    if (os_name := _OS.get(values.get("sys.platform", ""))) is not None:
        found.facts["os"] = os_name
    for key in ("machine", "cpu"):
        if values.get(key):
            found.facts[key] = values[key]
    if (ram := to_int(values.get("ram_bytes"))) is not None and ram > 0:
        found.facts["ram_bytes"] = ram
    return found


def parse_env(text: str) -> Findings:
    found = Findings()
    env = {}
    for line in text.splitlines():
        name, sep, value = line.partition("=")
        if sep and ENV_VARS.fullmatch(name.strip()):
            env[name.strip()] = value.strip()
    found.facts["env"] = env
    if "HSA_OVERRIDE_GFX_VERSION" in env:
        found.facts["hsa_override"] = env["HSA_OVERRIDE_GFX_VERSION"]
    if "WSL_DISTRO_NAME" in env or "WSL_INTEROP" in env:
        found.facts["wsl"] = True
    return found
