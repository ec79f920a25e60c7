"""GPU-to-GPU links from `nvidia-smi topo -m` and `rocm-smi --showtopo`: text -> facts, nothing else.

What DDP and FSDP gain from several GPUs depends on the slowest pair: NVLink / xGMI carry the
gradient all-reduce at hundreds of GB/s, PCIe through a CPU (or across sockets) at a tenth of that.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# Link kinds, fastest first. nvidia-smi: NV# (NVLink, # bonded links), PIX / PXB (PCIe switch),
# PHB / NODE (PCIe through a CPU's host bridge, same NUMA node), SYS (across CPU sockets).
# rocm-smi: XGMI, PCIE.
KINDS = ("nvlink", "xgmi", "pcie-switch", "pcie-cpu", "pcie", "pcie-sockets")
_NVIDIA = {"PIX": "pcie-switch", "PXB": "pcie-switch", "PHB": "pcie-cpu", "NODE": "pcie-cpu", "SYS": "pcie-sockets"}
_AMD = {"XGMI": "xgmi", "PCIE": "pcie"}
DESCRIPTIONS = {
    "nvlink": "NVLink", "xgmi": "xGMI (Infinity Fabric)", "pcie-switch": "PCIe through a switch",
    "pcie-cpu": "PCIe through the CPU", "pcie": "PCIe", "pcie-sockets": "PCIe across CPU sockets",
}


@dataclass(frozen=True)
class GpuTopology:
    gpus: int
    links: dict[tuple[int, int], str] = field(default_factory=dict)  # (i, j), i < j -> a KINDS entry
    numa_nodes: dict[int, str] = field(default_factory=dict)  # GPU -> its NUMA node (nvidia-smi only)

    def slowest(self) -> str | None:
        return max(self.links.values(), key=KINDS.index) if self.links else None


def _nvidia_kind(cell: str) -> str | None:
    if re.fullmatch(r"NV\d+", cell):
        return "nvlink"
    return _NVIDIA.get(cell)


def parse_nvidia_topo(text: str) -> GpuTopology | None:
    """`nvidia-smi topo -m`'s matrix (tab-separated; a legend follows). None: no GPU rows."""
    lines = text.splitlines()
    header = next((line for line in lines if "GPU0" in line and not line.startswith("GPU")), None)
    if header is None:
        return None
    columns = [c.strip() for c in header.split("\t")]
    rows = [line for line in lines if re.match(r"GPU\d+\t", line)]
    links, numa = {}, {}
    for row in rows:
        cells = [c.strip() for c in row.split("\t")]
        i = int(cells[0][3:])
        for name, cell in zip(columns[1:], cells[1:]):  # columns[0] is empty: the row labels' column
            if name.startswith("GPU") and name[3:].isdigit() and int(name[3:]) > i and (kind := _nvidia_kind(cell)):
                links[(i, int(name[3:]))] = kind
            elif name == "NUMA Affinity" and cell and cell != "N/A":
                numa[i] = cell
    return GpuTopology(len(rows), links, numa) if rows else None


def parse_rocm_topo(text: str) -> GpuTopology | None:
    """`rocm-smi --showtopo`'s "Link Type between two GPUs" table. None: no such table."""
    lines = text.splitlines()
    start = next((n for n, line in enumerate(lines) if "Link Type between two GPUs" in line), None)
    if start is None:
        return None
    links, gpus = {}, 0
    for line in lines[start + 1:]:
        if line.startswith("=") or not line.strip():
            if gpus:
                break
            continue
        cells = line.split()
        if not re.fullmatch(r"GPU\d+", cells[0]) or all(re.fullmatch(r"GPU\d+", c) for c in cells):
            continue  # the header row
        i = int(cells[0][3:])
        gpus += 1
        for j, cell in enumerate(cells[1:]):
            if j > i and cell.upper() in _AMD:
                links[(i, j)] = _AMD[cell.upper()]
    return GpuTopology(gpus, links) if gpus else None
