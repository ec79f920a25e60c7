"""nvidia-smi: the default table (Linux, WSL, Windows and R610+ headers), -L, -q and --query-gpu csv."""

from __future__ import annotations

import re

from unsloth.platform.facts import Gpu
from unsloth.platform.parsers import Findings, bus_id, key_values, to_int

# The probe's query, so header-less csv in exactly this column order needs no guessing.
QUERY_FIELDS = ("index", "name", "pci.bus_id", "pci.device_id", "memory.total", "compute_cap", "driver_version", "uuid")

_VERSION = r"(\d+(?:\.\d+)+)"
_HEADER_SMI = re.compile(r"NVIDIA-SMI\s+" + _VERSION)
_HEADER_DRIVER = re.compile(r"(?:Driver|KMD)\s+Version:\s*" + _VERSION)
_HEADER_CUDA = re.compile(r"CUDA(?:\s+UMD)?\s+Version:\s*(\S+)")
_TABLE_ROW = re.compile(
    r"^\|\s*(\d+)\s+(.+?)\s+(On|Off|WDDM|TCC|MCDM|N/A)\s*\|\s*"
    r"([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])"
)
_TABLE_MEMORY = re.compile(r"(\d+)\s*MiB\s*/\s*(\d+)\s*MiB")
_LIST_ROW = re.compile(r"^GPU\s+(\d+):\s*(.+?)\s*(?:\(UUID:\s*(GPU-[^)\s]+)\s*\))?\s*$")
_FAILURE = re.compile(r"^.*(?:NVIDIA-SMI has failed|Failed to initialize NVML|No devices were found).*$", re.M)
_MIB = 2**20


def parse(text: str) -> Findings:
    if failure := _FAILURE.search(text):
        return Findings(facts={"_error": failure.group(0).strip()})
    if "NVSMI LOG" in text or re.search(r"^\s*Product Name\s*:", text, re.M):
        return _parse_query_log(text)
    table_rows = any(_TABLE_ROW.match(line.strip()) for line in text.splitlines())
    if table_rows or _HEADER_SMI.search(text) or re.search(r"Persistence-M|TCC/WDDM|Driver-Model", text):
        return _parse_table(text)
    if re.search(r"^GPU\s+\d+:", text, re.M):
        return _parse_list(text)
    return _parse_csv(text)


def _version_facts(text: str) -> dict[str, str | None]:
    facts: dict[str, str | None] = {}
    if match := _HEADER_DRIVER.search(text):
        facts["nvidia_driver"] = match.group(1)
    if match := _HEADER_CUDA.search(text):
        # "ERR!" (driver/library mismatch) and "N/A" are not versions: the value stays unknown.
        value = match.group(1)
        facts["cuda_driver"] = value if re.fullmatch(r"\d+\.\d+(\.\d+)?", value) else None
    return facts


def _parse_table(text: str) -> Findings:
    found = Findings(facts=_version_facts(text))
    smi = _HEADER_SMI.search(text)
    windows = bool(re.search(r"TCC/WDDM|Driver-Model|nvidia-smi\.exe", text, re.I))
    linux = "Persistence-M" in text
    lines = text.splitlines()
    for number, line in enumerate(lines):
        row = _TABLE_ROW.match(line.strip())
        if not row:
            continue
        windows = windows or row.group(3) in ("WDDM", "TCC", "MCDM")
        gpu = Gpu(vendor="nvidia", index=int(row.group(1)), name=row.group(2).strip(), bus_id=bus_id(row.group(4)))
        following = lines[number + 1] if number + 1 < len(lines) else ""
        if memory := _TABLE_MEMORY.search(following):
            gpu.vram_bytes = int(memory.group(2)) * _MIB
        found.gpus.append(gpu)
    if windows:
        found.facts.update(os="windows", wsl=False)
    elif linux:
        found.facts["os"] = "linux"
        # Under WSL the Linux-side nvidia-smi talks to the Windows host driver: two versions.
        driver = found.facts.get("nvidia_driver")
        if smi and driver and smi.group(1) != driver:
            found.facts["wsl"] = True
    return found


def _parse_list(text: str) -> Findings:
    found = Findings()
    for line in text.splitlines():
        # Indented "MIG 1g.10gb Device 0: ..." lines are slices of the GPU above, not GPUs.
        if row := _LIST_ROW.match(line):
            found.gpus.append(Gpu(vendor="nvidia", index=int(row.group(1)), name=row.group(2), uuid=row.group(3)))
    return found


def _parse_query_log(text: str) -> Findings:
    header = re.split(r"^GPU\s+[0-9A-Fa-f]{4,8}:", text, maxsplit=1, flags=re.M)[0]
    found = Findings()
    top = key_values(header)
    driver = top.get("driver version") or top.get("kmd version")
    if driver and re.fullmatch(_VERSION, driver):
        found.facts["nvidia_driver"] = driver
    cuda = top.get("cuda version") or top.get("cuda umd version")
    if cuda is not None:
        found.facts["cuda_driver"] = cuda if re.fullmatch(r"\d+\.\d+(\.\d+)?", cuda) else None
    sections = re.split(r"^(?=GPU\s+[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]\s*$)", text, flags=re.M)[1:]
    for index, section in enumerate(sections):
        values = key_values(section)
        gpu = Gpu(
            vendor="nvidia",
            index=index,
            name=values.get("product name"),
            bus_id=bus_id(section.splitlines()[0]),
            uuid=values.get("gpu uuid"),
        )
        if (device := to_int(values.get("device id"))) is not None and device > 0xFFFF:
            gpu.pci_id = f"10de:{device >> 16:04x}"
        if memory := re.search(r"FB Memory Usage\s*\n\s*Total\s*:\s*(\d+)\s*MiB", section):
            gpu.vram_bytes = int(memory.group(1)) * _MIB
        if architecture := values.get("product architecture"):
            gpu.family = {"ada lovelace": "Ada"}.get(architecture.lower(), architecture)
        found.gpus.append(gpu)
        model = re.search(r"Driver Model\s*\n\s*Current\s*:\s*(\S+)", section)
        persistence = values.get("persistence mode")
        if model and model.group(1) in ("WDDM", "TCC", "MCDM"):
            # Windows prints N/A for persistence mode; a Linux-side (WSL) nvidia-smi prints a state.
            if persistence in ("Enabled", "Disabled"):
                found.facts.update(os="linux", wsl=True)
            else:
                found.facts.update(os="windows", wsl=False)
        elif model and persistence in ("Enabled", "Disabled"):
            found.facts["os"] = "linux"
    return found


def _parse_csv(text: str) -> Findings:
    found = Findings()
    lines = [line for line in text.splitlines() if line.count(",") >= 1]
    if not lines:
        return found
    header = [cell.strip().split(" ")[0] for cell in lines[0].split(",")]
    columns: list[str] | None = header if {"name", "index", "pci.bus_id", "uuid"} & set(header) else None
    if columns:
        lines = lines[1:]
    for line in lines:
        cells = [cell.strip() for cell in line.split(",")]
        names = columns or (list(QUERY_FIELDS) if len(cells) == len(QUERY_FIELDS) else _classify(cells))
        row = dict(zip(names, cells, strict=False))
        gpu = _gpu_from_row(row)
        if gpu:
            found.gpus.append(gpu)
        driver = row.get("driver_version", "")
        if re.fullmatch(_VERSION, driver):
            found.facts.setdefault("nvidia_driver", driver)
    return found


def _classify(cells: list[str]) -> list[str]:
    """Name the columns of header-less csv from what each value looks like."""
    names = []
    for position, cell in enumerate(cells):
        if cell.startswith("GPU-"):
            names.append("uuid")
        elif bus_id(cell) and ":" in cell:
            names.append("pci.bus_id")
        elif re.fullmatch(r"0x[0-9A-Fa-f]{8}", cell):
            names.append("pci.device_id")
        elif re.fullmatch(r"\d+\s*MiB", cell):
            names.append("memory.total")
        elif re.fullmatch(r"\d{1,2}\.\d", cell):
            names.append("compute_cap")
        elif re.fullmatch(r"\d{3}\.\d+(\.\d+)?", cell):
            names.append("driver_version")
        elif re.fullmatch(r"\d+", cell):
            names.append("index" if position == 0 else "memory.total")
        elif re.search(r"[A-Za-z]", cell):
            names.append("name")
        else:
            names.append("")
    return names


def _gpu_from_row(row: dict[str, str]) -> Gpu | None:
    name = row.get("name") or None
    if not name and not row.get("pci.bus_id") and not row.get("uuid"):
        return None
    gpu = Gpu(
        vendor="nvidia",
        name=name,
        bus_id=bus_id(row.get("pci.bus_id")),
        uuid=row.get("uuid") if (row.get("uuid") or "").startswith("GPU-") else None,
    )
    if (index := row.get("index", "")).isdigit():
        gpu.index = int(index)
    if (device := to_int(row.get("pci.device_id"))) is not None and device > 0xFFFF:
        gpu.pci_id = f"10de:{device >> 16:04x}"
    if memory := re.fullmatch(r"(\d+)(?:\s*MiB)?", row.get("memory.total", "")):
        gpu.vram_bytes = int(memory.group(1)) * _MIB
    if re.fullmatch(r"\d{1,2}\.\d", row.get("compute_cap", "")):
        gpu.compute_capability = row["compute_cap"]
    return gpu
