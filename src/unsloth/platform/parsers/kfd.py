"""KFD topology: /sys/class/kfd/kfd/topology/nodes/*/properties, 'key value' lines, one block per
node (the probe writes a '== <path> ==' header before each). gfx_target_version is the physical
ASIC: HSA_OVERRIDE_GFX_VERSION cannot change it."""

from __future__ import annotations

import re

from unsloth.platform.facts import Gpu
from unsloth.platform.parsers import Findings, blocks, pci_id

_HEADER = re.compile(r"^\s*(==|#).*")


def gfx_from_target_version(value: int) -> str | None:
    """110501 -> 'gfx1151', 90010 -> 'gfx90a': major = v // 10000, minor and stepping in hex."""
    major, minor, stepping = value // 10000, (value // 100) % 100, value % 100
    if not 7 <= major <= 15 or minor > 15 or stepping > 15:
        return None
    return f"gfx{major}{minor:x}{stepping:x}"


def parse(text: str) -> Findings:
    found = Findings()
    nodes = blocks(text, _HEADER) or [text]
    for node in nodes:
        props = _properties(node)
        if props.get("simd_count", 0) <= 0 or props.get("gfx_target_version", 0) <= 0:
            continue  # a CPU-only node
        found.facts["os"] = "linux"
        gpu = Gpu(vendor="amd", arch=gfx_from_target_version(props["gfx_target_version"]), index=len(found.gpus))
        if node_id := re.search(r"/nodes/(\d+)/", node.splitlines()[0] if node else ""):
            gpu.kfd_node = int(node_id.group(1))
        gpu.pci_id = pci_id(props.get("vendor_id"), props.get("device_id"))
        if "location_id" in props:
            location = props["location_id"]
            gpu.bus_id = (
                f"{props.get('domain', 0):04x}:{location >> 8:02x}:{(location >> 3) & 0x1F:02x}.{location & 0x7}"
            )
        # An APU shown as one node carries both CPU cores and SIMDs. (local_mem_size is 0 on
        # dGPUs too in recent kernels, so only a positive value says anything.)
        if props.get("cpu_cores_count", 0) > 0:
            gpu.integrated = True
        elif props.get("local_mem_size", 0) > 0:
            gpu.vram_bytes = props["local_mem_size"]
        found.gpus.append(gpu)
    return found


def _properties(text: str) -> dict[str, int]:
    props: dict[str, int] = {}
    for line in text.splitlines():
        match = re.fullmatch(r"\s*([a-z_0-9]+)\s+(\d+)\s*", line)
        if match:
            props.setdefault(match.group(1), int(match.group(2)))
    return props
