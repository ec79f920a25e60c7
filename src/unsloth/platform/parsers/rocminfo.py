"""rocminfo: HSA agents. Whole output, several GPUs among CPU agents, failures, and excerpts that
start at an agent's 'Name:' line without the 'Agent N' header."""

from __future__ import annotations

import re

from unsloth.platform.facts import Gpu
from unsloth.platform.parsers import Findings, blocks, key_values, pci_id, to_int

_AGENT_HEADER = re.compile(r"^\s*Agent\s+\d+\s*$")
_TOP_LEVEL_NAME = re.compile(r"^ {0,2}Name:")  # nested ISA/pool names are indented deeper
_GFX = re.compile(r"gfx[0-9a-f]{3,4}")


def parse(text: str) -> Findings:
    found = Findings()
    if error := re.search(r"^.*(?:ROCk module is NOT loaded|HSA_STATUS_ERROR|Unable to open /dev/kfd).*$", text, re.M):
        found.facts["_error"] = error.group(0).strip()
    if re.search(r"HSA Agents|HSA System Attributes|ROCk module|Device Type:\s*(GPU|CPU)", text):
        found.facts["os"] = "linux"  # rocminfo exists only on Linux (Windows ships hipInfo)
    agents = blocks(text, _AGENT_HEADER) or blocks(text, _TOP_LEVEL_NAME)
    for agent in agents:
        if gpu := _gpu(agent):
            gpu.index = len(found.gpus)
            found.gpus.append(gpu)
    if found.gpus:
        found.facts["os"] = "linux"
    return found


def _gpu(agent: str) -> Gpu | None:
    values = key_values(agent)
    device_type = values.get("device type", "")
    name = values.get("name", "")
    if device_type and device_type.upper() != "GPU":
        return None
    arch_match = _GFX.match(name) or _GFX.search(agent)
    if not device_type and not _GFX.match(name):
        return None  # a headless fragment or a CPU agent cut before its type
    gpu = Gpu(vendor="amd", arch=arch_match.group(0) if arch_match else None, name=values.get("marketing name") or None)
    if uuid := values.get("uuid"):
        gpu.uuid = uuid if uuid.startswith("GPU-") and uuid != "GPU-XX" else None
    gpu.pci_id = pci_id(0x1002, to_int(values.get("chip id")))
    gpu.kfd_node = to_int(values.get("node"))
    if (bdf := to_int(values.get("bdfid"))) is not None:
        domain = to_int(values.get("domain")) or 0
        gpu.bus_id = f"{domain:04x}:{bdf >> 8:02x}:{(bdf >> 3) & 0x1F:02x}.{bdf & 0x7}"
    pool = re.search(r"Segment:\s*GLOBAL[^\n]*\n\s*Size:\s*(\d+)\(0x[0-9a-f]+\)\s*KB", agent)
    if pool:
        gpu.vram_bytes = int(pool.group(1)) * 1024
    return gpu
