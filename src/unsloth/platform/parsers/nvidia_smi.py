"""nvidia-smi: the default table (Linux, WSL, Windows and R610+ headers), -L, -q and --query-gpu csv."""

from __future__ import annotations

import re

from unsloth.platform.facts import Gpu
from unsloth.platform.parsers import Findings, bus_id, key_values, product_vendor, to_int

# The probe's query, so header-less csv in exactly this column order needs no guessing.
QUERY_FIELDS = ("index", "name", "pci.bus_id", "pci.device_id", "memory.total", "compute_cap", "driver_version", "uuid")

_VERSION = r"(\d+(?:\.\d+)+)"
_HEADER_SMI = re.compile(r"NVIDIA-SMI\s+" + _VERSION)
_HEADER_DRIVER = re.compile(r"(?:Driver|KMD)\s+Version:\s*" + _VERSION)
_HEADER_CUDA = re.compile(r"CUDA(?:\s+UMD)?\s+Version:\s*(\S+)")
_TABLE_ROW = re.compile(
    r"^\|\s*(\d+)\s+(.+?)\s+(On|Off|WDDM|TCC|MCDM|N/A)\s*\|\s*"
    r"([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]|N/A)"  # Jetson: no PCI bus
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
    # `-q -i N` details one GPU but still counts them all: the others exist, unknown but for that.
    attached = to_int(top.get("attached gpus"))
    attached = attached if attached is not None and len(sections) < attached <= 64 else None
    for index, section in enumerate(sections):
        values = key_values(section)
        gpu = Gpu(
            vendor="nvidia",
            index=None if attached else index,  # which ordinal a filtered section is, -q does not say
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
        elif persistence in ("Enabled", "Disabled"):
            found.facts["os"] = "linux"  # a persistence mode exists only on Linux
    found.gpus += [Gpu(vendor="nvidia") for _ in range((attached or 0) - len(sections))]
    return found


# Field names nvidia-smi prints in a csv header (`nvidia-smi --help-query-gpu`); any of them
# marks a header row, whose other cells must look like field names too.
QUERY_HEADER_FIELDS = frozenset(
    {*QUERY_FIELDS, "count", "gpu_name", "gpu_bus_id", "gpu_uuid", "serial", "memory.used", "memory.free",
     "memory.reserved", "pci.sub_device_id", "pci.domain", "pci.bus", "pci.device", "vbios_version",
     "temperature.gpu", "utilization.gpu", "utilization.memory", "power.draw", "power.limit", "pstate",
     "persistence_mode", "driver_model.current", "clocks.max.sm", "clocks.sm", "compute_mode", "display_mode"}
)
_FIELD = re.compile(r"[a-z][a-z0-9_]*(?:\.[a-z0-9_]+)*")
_UNIT = re.compile(r"\s*\[[^\]]*\]\s*$")  # 'memory.total [MiB]'
_MISSING = re.compile(r"\[?(N/A|Not Supported|Unknown Error|Insufficient Permissions|Requested functionality has been deprecated)\]?")


_ALIASES = {"gpu_name": "name", "gpu_bus_id": "pci.bus_id", "gpu_uuid": "uuid"}


def _header(line: str) -> list[str] | None:
    names = [_UNIT.sub("", cell.strip()) for cell in line.split(",")]
    if all(_FIELD.fullmatch(name) for name in names) and QUERY_HEADER_FIELDS & set(names):
        return [_ALIASES.get(name, name) for name in names]
    return None


def _cells(line: str) -> list[str]:
    return ["" if _MISSING.fullmatch(cell.strip()) else cell.strip() for cell in line.split(",")]


def _parse_csv(text: str) -> Findings:
    """--query-gpu csv: under a header row, columns by name (units in the header or the values);
    without one, the probe's own column order, or columns named by what each value looks like
    when every value looks like something and the row carries an NVIDIA name or id. Anything
    else is not nvidia-smi output and gives nothing."""
    found = Findings()
    columns: list[str] | None = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if (header := _header(line)) is not None:
            columns = header
            continue
        cells = _cells(line)
        if columns is not None and len(cells) == len(columns) and _fits(cells, columns):
            row = dict(zip(columns, cells, strict=True))
        else:
            columns = None  # the table under a header ends at the first line that does not fit it
            row = _headerless_row(cells)
            if row is None:
                continue
        if gpu := _gpu_from_row(row):
            found.gpus.append(gpu)
        driver = row.get("driver_version", "")
        if re.fullmatch(_VERSION, driver):
            found.facts.setdefault("nvidia_driver", driver)
    return found


def _headerless_row(cells: list[str]) -> dict[str, str] | None:
    if len(cells) == len(QUERY_FIELDS) and _fits(cells, QUERY_FIELDS):
        return dict(zip(QUERY_FIELDS, cells, strict=True))
    kinds = _classify(cells)
    if not kinds or "" in kinds or len(set(kinds)) != len(kinds):
        return None
    row = dict(zip(kinds, cells, strict=True))
    named = product_vendor(row.get("name")) == "nvidia"
    if not (named or row.get("uuid") or row.get("pci.bus_id") or row.get("pci.device_id")):
        return None
    return row


def _fits(cells: list[str], columns: list[str] | tuple[str, ...]) -> bool:
    """Every non-empty value has the form its column's values have (columns we do not read: any)."""
    for cell, kind, column in zip(cells, _classify(cells), columns, strict=True):
        if not cell or column not in _FORMS:
            continue
        if kind != column and {kind, column} != {"index", "memory.total"}:  # both can be bare numbers
            return False
    return True


_FORMS = ("uuid", "pci.bus_id", "pci.device_id", "memory.total", "compute_cap", "driver_version", "index", "name")


def _classify(cells: list[str]) -> list[str]:
    """Name the columns of header-less csv from what each value looks like ('' where nothing fits)."""
    names = []
    for position, cell in enumerate(cells):
        if not cell:
            names.append("")
        elif re.fullmatch(r"GPU-[0-9a-fA-F-]+", cell):
            names.append("uuid")
        elif re.fullmatch(r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]", cell):
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
        elif re.fullmatch(r"[A-Za-z][\w .()/+-]{1,60}", cell):
            names.append("name")
        else:
            names.append("")
    return names


def _gpu_from_row(row: dict[str, str]) -> Gpu | None:
    name = row.get("name") or None
    if not any(row.get(column) for column in ("name", "pci.bus_id", "uuid", "pci.device_id", "compute_cap")):
        return None
    gpu = Gpu(
        vendor="nvidia",
        name=name,
        bus_id=bus_id(row.get("pci.bus_id")),
        uuid=row.get("uuid") if (row.get("uuid") or "").startswith("GPU-") else None,
    )
    if (index := row.get("index", "")).isdigit():
        gpu.index = int(index)
    # pci.device_id is 0xDDDDVVVV: the device id in the high 16 bits, NVIDIA's 10DE below.
    if (device := to_int(row.get("pci.device_id"))) is not None and device & 0xFFFF == 0x10DE:
        gpu.pci_id = f"10de:{device >> 16:04x}"
    if memory := re.fullmatch(r"(\d+)(?:\s*MiB)?", row.get("memory.total", "")):
        gpu.vram_bytes = int(memory.group(1)) * _MIB
    if re.fullmatch(r"\d{1,2}\.\d", row.get("compute_cap", "")):
        gpu.compute_capability = row["compute_cap"]
    return gpu
