"""Load hardware_matrix.toml and validate it into typed tables.

The matrix is data users may edit (UNSLOTH_MATRIX points at their copy), so every mistake is
reported as a MatrixError naming the file, the entry and what is wrong, never as a KeyError deep
inside the planner.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from unsloth.errors import ExitCode, UnslothError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

SCHEMA = 1
OSES = ("linux", "wsl", "windows", "macos")  # the columns plan.os_cell produces
REQUIRED_FAMILIES = ("CPU", "Apple")
LEVELS = ("full", "limited", "unsupported")
VENDORS = ("nvidia", "amd", "intel", "apple", "none")
BACKENDS = ("cuda", "rocm", "mps", "cpu", "vulkan", "xpu")
LLAMA_BACKENDS = ("cuda", "hip", "vulkan", "metal", "cpu")
FLA_BACKENDS = ("cuda", "rocm", "xpu")  # flash-linear-attention's kernels are Triton: GPU backends only
FLA_NAME = "flash-linear-attention"
REQUIRED_URLS = ("pytorch", "pypi", "amd", "llama_cpp_wheels", "rocm_install", "rocm_wsl", "nvidia_driver")
ENV_VAR = "UNSLOTH_MATRIX"


class MatrixError(UnslothError, ValueError):
    """The matrix file is missing, unparsable, or an entry in it is wrong."""

    exit_code = ExitCode.USAGE


@dataclass(frozen=True)
class Family:
    name: str
    vendor: str
    archs: tuple[str, ...]
    products: str
    source: str
    hsa_override: dict[str, str] = field(default_factory=dict)  # arch -> "10.3.0"
    amd_index: dict[str, str] = field(default_factory=dict)  # arch -> repo.amd.com family leaf


@dataclass(frozen=True)
class SupportCell:
    family: str
    os: str
    level: str
    reason: str
    source: str


@dataclass(frozen=True)
class CudaIndex:
    variant: str  # "cu130"
    cuda: Version
    driver: dict[str, Version]  # "linux" | "windows" -> minimum driver
    sm: tuple[Version, Version]  # compute capabilities the wheels cover, inclusive
    torch: str  # version specifier, e.g. ">=2.9,<2.14"
    source: str

    def covers(self, compute_capability: Version) -> bool:
        return self.sm[0] <= compute_capability <= self.sm[1]


@dataclass(frozen=True)
class RocmIndex:
    variant: str  # "rocm7.2"
    rocm: Version
    archs: frozenset[str]
    torch: str
    source: str


@dataclass(frozen=True)
class BitsandbytesRow:
    backend: str
    oses: tuple[str, ...]
    spec: str
    source: str
    sm: tuple[Version, Version] | None = None
    archs: frozenset[str] | None = None


@dataclass(frozen=True)
class VllmRow:
    """vLLM's wheels for one backend: where they exist, and the exact torch they were built against."""

    backend: str
    oses: tuple[str, ...]
    machines: tuple[str, ...]  # CPU architectures with a wheel: "x86_64", "aarch64"
    spec: str  # "vllm==0.32.0"
    variant: str  # the PyTorch index its torch comes from: "cu130"
    torch: str  # the torch it pins: "==2.13.0"
    torch_packages: tuple[str, ...]  # the rest of the PyTorch family it pins: "torchvision==0.28.0"
    python: str  # the Pythons its wheels install on: ">=3.11,<3.15"
    source: str


@dataclass(frozen=True)
class FlaRow:
    """flash-linear-attention for one torch backend, and the GPUs on which some Tritons break it."""

    backend: str
    oses: tuple[str, ...]
    spec: str  # "flash-linear-attention==0.6.0"
    source: str
    broken_sm: tuple[Version, Version] | None = None  # compute capabilities (inclusive) where ...
    broken_triton: str | None = None  # ... these Tritons give wrong results: ">=3.4.0,<3.7.1"


@dataclass(frozen=True)
class LlamaCppRow:
    backend: str
    oses: tuple[str, ...]
    wheel: dict[str, str]  # torch variant (or backend) -> llama-cpp-python wheel tag
    cmake_args: str
    source: str
    wheel_archs: frozenset[str] | None = None  # gfx targets the prebuilt wheel covers


@dataclass(frozen=True)
class EnvRow:
    backend: str
    oses: tuple[str, ...]
    vars: dict[str, str]
    source: str


@dataclass(frozen=True)
class Fits:
    qlora_bytes_per_param: float
    lora16_bytes_per_param: float
    overhead: float
    fixed_gib: float
    model_sizes_b: tuple[float, ...]
    source: str


@dataclass(frozen=True)
class Matrix:
    path: str
    oses: tuple[str, ...]
    urls: dict[str, str]
    families: dict[str, Family]
    support: dict[tuple[str, str], SupportCell]  # (family, os) -> cell, complete
    cuda_indexes: tuple[CudaIndex, ...]  # newest first
    rocm_indexes: tuple[RocmIndex, ...]  # newest first
    bitsandbytes: tuple[BitsandbytesRow, ...]
    llama_cpp: tuple[LlamaCppRow, ...]
    env: tuple[EnvRow, ...]
    amd_torch: str  # torch specifier for AMD's own wheel indexes
    attention: dict[str, str]  # torch backend -> attn_implementation
    fits: Fits
    sources: dict[str, str]  # section -> citation, for sections without rows
    xpu_torch: str | None = None  # torch specifier for PyTorch's XPU index (Intel Arc); None: no XPU builds
    vllm: tuple[VllmRow, ...] = ()  # where `--with vllm` can install it; none: refused everywhere
    flash_linear_attention: tuple[FlaRow, ...] = ()  # where it is installed; none: nowhere
    torch_triton: dict[Version, Version] = field(default_factory=dict)  # torch release -> the Triton it pins

    def family_of(self, arch: str) -> Family | None:
        for family in self.families.values():
            if arch in family.archs:
                return family
        return None

    def cell(self, family: str, os_name: str) -> SupportCell:
        return self.support[(family, os_name)]


def default_path() -> Path:
    """The packaged matrix, src/unsloth/hardware_matrix.toml (a real file, not a link, so a checkout
    without symlinks, as on Windows, has it too; the repository root shows the same bytes)."""
    return Path(__file__).with_name("hardware_matrix.toml")


def load_matrix(path: str | os.PathLike[str] | None = None) -> Matrix:
    """Read and validate the matrix: `path`, else $UNSLOTH_MATRIX, else the packaged file."""
    from_env = not path and bool(os.environ.get(ENV_VAR))
    chosen = Path(path or os.environ.get(ENV_VAR) or default_path())
    hint = f" (set by {ENV_VAR})" if from_env else ""
    fix = (f"point {ENV_VAR} at a valid hardware_matrix.toml, or unset it to use the packaged one" if from_env
           else "reinstall unsloth: its packaged hardware_matrix.toml is damaged")
    try:
        text = chosen.read_text(encoding="utf-8")
    except OSError as exc:
        raise MatrixError(f"{chosen}{hint}: cannot read the hardware matrix: {exc.strerror or exc}", fix) from exc
    except UnicodeDecodeError as exc:  # random bytes, a binary file
        raise MatrixError(f"{chosen}{hint}: the hardware matrix is not text (byte {exc.start} is not UTF-8)",
                          fix) from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise MatrixError(f"{chosen}{hint}: not valid TOML: {exc}", fix) from exc
    try:
        return parse_matrix(data, str(chosen))
    except MatrixError as exc:
        exc.fix = exc.fix or fix
        raise


def parse_matrix(data: dict[str, Any], path: str = "<matrix>") -> Matrix:
    """Validate already-parsed TOML data. Pure; raises MatrixError naming the first bad entry."""
    if data.get("schema") != SCHEMA:
        raise MatrixError(f"{path}: schema = {data.get('schema')!r}, this unsloth reads schema = {SCHEMA}")
    oses = tuple(_str_list(_Entry(path, "oses", {"oses": data.get("oses")}), "oses"))
    if sorted(oses) != sorted(OSES):
        raise MatrixError(f"{path}: oses = {list(oses)}; the planner needs exactly {list(OSES)}")

    urls_entry = _table(data, "urls", path, *REQUIRED_URLS, "source")
    urls = {name: _url(urls_entry, name) for name in REQUIRED_URLS}
    families = _families(data, path)
    archs = {arch: family.name for family in families.values() for arch in family.archs}
    amd_entry = _table(data, "amd_wheels", path, "torch", "source")
    attention_entry = _table(data, "attention", path, *BACKENDS, "source")
    xpu_entry = _table(data, "xpu_wheels", path, "torch", "source") if "xpu_wheels" in data else None
    cuda_indexes = _cuda_indexes(data, path)
    torch_triton_entry = _table(data, "torch_triton", path, "releases", "source") if "torch_triton" in data else None
    fla = _flash_linear_attention(data, path, oses)
    if torch_triton_entry is None and any(row.broken_triton for row in fla):
        raise MatrixError(f"{path}: a flash_linear_attention row has broken_triton, but there is no [torch_triton] "
                          "table to tell which Triton the plan's torch brings")
    return Matrix(
        path=path,
        oses=oses,
        urls=urls,
        families=families,
        support=_support(data, path, families, oses),
        cuda_indexes=cuda_indexes,
        rocm_indexes=_rocm_indexes(data, path, archs),
        bitsandbytes=_bitsandbytes(data, path, oses, archs),
        llama_cpp=_llama_cpp(data, path, oses, archs),
        env=tuple(
            EnvRow(entry.choice("backend", BACKENDS), entry.oses(oses), entry.str_map("vars"), entry.source())
            for entry in _rows(data, "env", path, "backend", "os", "vars", "source", required=False)
        ),
        amd_torch=amd_entry.specifier("torch"),
        attention={key: attention_entry.text(key) for key in attention_entry.data if key != "source"},
        fits=_fits(data, path),
        sources={"urls": urls_entry.source(), "amd_wheels": amd_entry.source(), "attention": attention_entry.source(),
                 **({"xpu_wheels": xpu_entry.source()} if xpu_entry else {}),
                 **({"torch_triton": torch_triton_entry.source()} if torch_triton_entry else {})},
        xpu_torch=xpu_entry.specifier("torch") if xpu_entry else None,
        vllm=_vllm(data, path, oses, {index.variant for index in cuda_indexes}),
        flash_linear_attention=fla,
        torch_triton=_torch_triton(torch_triton_entry) if torch_triton_entry else {},
    )


def _families(data: dict[str, Any], path: str) -> dict[str, Family]:
    families: dict[str, Family] = {}
    owner: dict[str, str] = {}  # arch -> family
    for entry in _rows(
        data, "family", path, "name", "vendor", "archs", "products", "source", "hsa_override", "amd_index"
    ):
        name = entry.text("name")
        if name in families:
            raise entry.error("duplicate family")
        archs = tuple(entry.str_list("archs"))
        for arch in archs:
            if arch in owner:
                raise entry.error(f"arch {arch!r} is also in family {owner[arch]!r}")
            owner[arch] = name
        overrides = entry.str_map("hsa_override", required=False)
        amd_index = entry.str_map("amd_index", required=False)
        for arch in [*overrides, *amd_index]:
            if arch not in archs:
                raise entry.error(f"arch {arch!r} is not in its archs {list(archs)}")
        for arch, value in overrides.items():
            if not re.fullmatch(r"\d+\.\d+\.\d+", value):  # ROCm reads MAJOR.MINOR.STEPPING, nothing else
                raise entry.error(f"'hsa_override.{arch}' = {value!r} is not a version MAJOR.MINOR.STEPPING ('10.3.0')")
        families[name] = Family(
            name, entry.choice("vendor", VENDORS), archs, entry.text("products"), entry.source(), overrides, amd_index
        )
    for name in REQUIRED_FAMILIES:  # what the planner falls back to without a usable GPU
        if name not in families:
            raise MatrixError(f"{path}: missing family {name!r} (the plan without a usable GPU)")
    return families


def _support(
    data: dict[str, Any], path: str, families: dict[str, Family], oses: tuple[str, ...]
) -> dict[tuple[str, str], SupportCell]:
    support: dict[tuple[str, str], SupportCell] = {}
    for entry in _rows(data, "support", path, "family", "os", "level", "reason", "source"):
        names = entry.str_or_list("family")
        cell_oses, level = entry.oses(oses), entry.choice("level", LEVELS)
        reason, source = entry.text("reason"), entry.source()
        for name in names:
            if name not in families:
                raise entry.error(f"unknown family {name!r}; known: {', '.join(families)}")
            for os_name in cell_oses:
                if (name, os_name) in support:
                    raise entry.error(f"duplicate row: {name} x {os_name} is already covered")
                support[(name, os_name)] = SupportCell(name, os_name, level, reason, source)
    missing = [f"{name} x {os_name}" for name in families for os_name in oses if (name, os_name) not in support]
    if missing:
        raise MatrixError(f"{path}: support has no row for {', '.join(missing)}")
    return support


def _cuda_indexes(data: dict[str, Any], path: str) -> tuple[CudaIndex, ...]:
    indexes = []
    for entry in _rows(data, "cuda_index", path, "variant", "cuda", "driver", "sm", "torch", "source"):
        variant = entry.text("variant")
        drivers = entry.str_map("driver")
        if set(drivers) != {"linux", "windows"}:
            raise entry.error(f"driver must give exactly 'linux' and 'windows', got {sorted(drivers)}")
        driver = {key: _version(entry, f"driver.{key}", value) for key, value in drivers.items()}
        indexes.append(
            CudaIndex(
                variant,
                entry.version("cuda"),
                driver,
                entry.version_range("sm"),
                entry.specifier("torch"),
                entry.source(),
            )
        )
    _unique(path, "cuda_index", [index.variant for index in indexes])
    return tuple(indexes)


def _rocm_indexes(data: dict[str, Any], path: str, archs: dict[str, str]) -> tuple[RocmIndex, ...]:
    indexes = []
    for entry in _rows(data, "rocm_index", path, "variant", "rocm", "archs", "torch", "source"):
        variant = entry.text("variant")
        shipped = frozenset(entry.archs("archs", archs))
        indexes.append(RocmIndex(variant, entry.version("rocm"), shipped, entry.specifier("torch"), entry.source()))
    _unique(path, "rocm_index", [index.variant for index in indexes])
    return tuple(indexes)


def _bitsandbytes(
    data: dict[str, Any], path: str, oses: tuple[str, ...], archs: dict[str, str]
) -> tuple[BitsandbytesRow, ...]:
    rows = []
    for entry in _rows(data, "bitsandbytes", path, "backend", "os", "spec", "sm", "archs", "source"):
        spec = entry.text("spec")
        try:
            Requirement(spec)
        except InvalidRequirement as exc:
            raise entry.error(f"spec {spec!r} is not a requirement: {exc}") from exc
        rows.append(
            BitsandbytesRow(
                backend=entry.choice("backend", BACKENDS),
                oses=entry.oses(oses),
                spec=spec,
                source=entry.source(),
                sm=entry.version_range("sm") if "sm" in entry.data else None,
                archs=frozenset(entry.archs("archs", archs)) if "archs" in entry.data else None,
            )
        )
    return tuple(rows)


def _llama_cpp(
    data: dict[str, Any], path: str, oses: tuple[str, ...], archs: dict[str, str]
) -> tuple[LlamaCppRow, ...]:
    rows = []
    for entry in _rows(data, "llama_cpp", path, "backend", "os", "wheel", "wheel_archs", "cmake_args", "source"):
        rows.append(
            LlamaCppRow(
                backend=entry.choice("backend", LLAMA_BACKENDS),
                oses=entry.oses(oses),
                wheel=entry.str_map("wheel"),
                cmake_args=entry.text("cmake_args", allow_empty=True),
                source=entry.source(),
                wheel_archs=frozenset(entry.archs("wheel_archs", archs)) if "wheel_archs" in entry.data else None,
            )
        )
    if not any(row.backend == "cpu" and set(row.oses) == set(oses) for row in rows):
        raise MatrixError(f"{path}: llama_cpp needs a 'cpu' row for every OS (the fallback)")
    return tuple(rows)


def _vllm(data: dict[str, Any], path: str, oses: tuple[str, ...], variants: set[str]) -> tuple[VllmRow, ...]:
    rows = []
    for entry in _rows(data, "vllm", path, "backend", "os", "machines", "spec", "variant", "torch", "torch_packages",
                       "python", "source", required=False):
        spec = entry.requirement("spec")
        if spec.name != "vllm" or not any(s.operator in ("==", "===") for s in spec.specifier):
            raise entry.error(f"spec {str(spec)!r} must pin one vllm release (vllm==X): its torch pin is for that one")
        variant = entry.text("variant")
        if variant not in variants:
            raise entry.error(f"variant {variant!r} is not a cuda_index variant ({', '.join(sorted(variants))})")
        packages = entry.str_list("torch_packages") if "torch_packages" in entry.data else []
        for text in packages:
            entry.requirement_text("torch_packages", text)
        rows.append(VllmRow(
            backend=entry.choice("backend", ("cuda",)),  # its published wheels are CUDA builds, from a cuda_index
            oses=entry.oses(oses),
            machines=tuple(entry.str_list("machines")),
            spec=str(spec),
            variant=variant,
            torch=entry.specifier("torch"),
            torch_packages=tuple(packages),
            python=entry.specifier("python"),
            source=entry.source(),
        ))
    return tuple(rows)


def _flash_linear_attention(data: dict[str, Any], path: str, oses: tuple[str, ...]) -> tuple[FlaRow, ...]:
    rows = []
    for entry in _rows(data, "flash_linear_attention", path, "backend", "os", "spec", "broken_sm", "broken_triton",
                       "source", required=False):
        backend = entry.text("backend")
        if backend not in FLA_BACKENDS:
            raise entry.error(f"bad backend {backend!r}: its kernels are Triton, which runs on "
                              f"{', '.join(FLA_BACKENDS)} GPUs only")
        spec = entry.requirement("spec")
        if spec.name != FLA_NAME:
            raise entry.error(f"spec {str(spec)!r} must name {FLA_NAME}")
        if ("broken_sm" in entry.data) != ("broken_triton" in entry.data):
            raise entry.error("broken_sm and broken_triton go together: the GPUs, and the Tritons that break it on them")
        if "broken_sm" in entry.data and backend != "cuda":
            raise entry.error("broken_sm names NVIDIA compute capabilities: only a 'cuda' row can have it")
        rows.append(FlaRow(
            backend=backend,
            oses=entry.oses(oses),
            spec=str(spec),
            source=entry.source(),
            broken_sm=entry.version_range("broken_sm") if "broken_sm" in entry.data else None,
            broken_triton=entry.specifier("broken_triton") if "broken_triton" in entry.data else None,
        ))
    return tuple(rows)


def _torch_triton(entry: _Entry) -> dict[Version, Version]:
    releases = entry.str_map("releases")
    if not releases:
        raise entry.error("'releases' lists no torch release")
    return {_version(entry, "releases", torch): _version(entry, f"releases.{torch}", triton)
            for torch, triton in releases.items()}


def _fits(data: dict[str, Any], path: str) -> Fits:
    entry = _table(data, "fits", path, *(f.name for f in fields(Fits)))
    return Fits(
        qlora_bytes_per_param=entry.number("qlora_bytes_per_param"),
        lora16_bytes_per_param=entry.number("lora16_bytes_per_param"),
        overhead=entry.number("overhead"),
        fixed_gib=entry.number("fixed_gib"),
        model_sizes_b=tuple(entry.number_list("model_sizes_b")),
        source=entry.source(),
    )


# --- validation helpers -------------------------------------------------------------------------


class _Entry:
    """One TOML table being validated; every error names the file and this entry."""

    def __init__(self, path: str, label: str, data: dict[str, Any]):
        self.path, self.label, self.data = path, label, data

    def error(self, problem: str) -> MatrixError:
        return MatrixError(f"{self.path}: {self.label}: {problem}")

    def only(self, *keys: str) -> None:
        """Reject keys the schema does not know: a typo ("souce") must not pass silently."""
        for key in self.data:
            if key not in keys:
                raise self.error(f"unknown key '{key}'; expected {', '.join(keys)}")

    def _get(self, key: str) -> Any:
        if key not in self.data:
            raise self.error(f"missing '{key}'")
        return self.data[key]

    def text(self, key: str, *, allow_empty: bool = False) -> str:
        value = self._get(key)
        if not isinstance(value, str) or (not allow_empty and not value.strip()):
            raise self.error(f"'{key}' must be a non-empty string, got {value!r}")
        return value

    def source(self) -> str:
        return self.text("source")

    def str_list(self, key: str) -> list[str]:
        return _str_list(self, key)

    def str_or_list(self, key: str) -> list[str]:
        value = self._get(key)
        return [value] if isinstance(value, str) else _str_list(self, key)

    def choice(self, key: str, allowed: tuple[str, ...]) -> str:
        value = self.text(key)
        if value not in allowed:
            raise self.error(f"bad {key} {value!r}; expected one of {', '.join(allowed)}")
        return value

    def oses(self, known: tuple[str, ...]) -> tuple[str, ...]:
        values = self.str_or_list("os")
        for value in values:
            if value not in known:
                raise self.error(f"unknown os {value!r}; expected one of {', '.join(known)}")
        return tuple(values)

    def str_map(self, key: str, *, required: bool = True) -> dict[str, str]:
        if key not in self.data and not required:
            return {}
        value = self._get(key)
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise self.error(f"'{key}' must be a table of strings, got {value!r}")
        return dict(value)

    def version(self, key: str) -> Version:
        return _version(self, key, self.text(key))

    def version_range(self, key: str) -> tuple[Version, Version]:
        values = self.str_list(key)
        if len(values) != 2:
            raise self.error(f"'{key}' must be [lowest, highest], got {values!r}")
        low, high = (_version(self, key, value) for value in values)
        if low > high:
            raise self.error(f"'{key}' range {values!r} is reversed")
        return low, high

    def specifier(self, key: str) -> str:
        value = self.text(key)
        try:
            SpecifierSet(value)
        except InvalidSpecifier as exc:
            raise self.error(f"'{key}' {value!r} is not a version specifier: {exc}") from exc
        return value

    def requirement(self, key: str) -> Requirement:
        return self.requirement_text(key, self.text(key))

    def requirement_text(self, key: str, value: str) -> Requirement:
        try:
            return Requirement(value)
        except InvalidRequirement as exc:
            raise self.error(f"'{key}' {value!r} is not a requirement: {exc}") from exc

    def archs(self, key: str, known: dict[str, str]) -> list[str]:
        values = self.str_list(key)
        for value in values:
            if value not in known:
                raise self.error(f"'{key}' names arch {value!r}, which no family lists")
        return values

    def number(self, key: str) -> float:
        value = self._get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise self.error(f"'{key}' must be a non-negative number, got {value!r}")
        return float(value)

    def number_list(self, key: str) -> list[float]:
        value = self._get(key)
        if not isinstance(value, list) or not value:
            raise self.error(f"'{key}' must be a non-empty list of numbers, got {value!r}")
        return [self.number_in(key, item) for item in value]

    def number_in(self, key: str, item: Any) -> float:
        return _Entry(self.path, self.label, {key: item}).number(key)


def _str_list(entry: _Entry, key: str) -> list[str]:
    value = entry._get(key)
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        raise entry.error(f"'{key}' must be a list of strings, got {value!r}")
    if len(set(value)) != len(value):
        raise entry.error(f"'{key}' lists a value twice: {value!r}")
    return value


def _version(entry: _Entry, key: str, value: str) -> Version:
    try:
        return Version(value)
    except InvalidVersion as exc:
        raise entry.error(f"'{key}' = {value!r} is not a version") from exc


def _url(entry: _Entry, key: str) -> str:
    value = entry.text(key)
    parsed = urlparse(value)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise entry.error(f"'{key}' = {value!r} is not an http(s) URL")
    return value


def _table(data: dict[str, Any], key: str, path: str, *keys: str) -> _Entry:
    value = data.get(key)
    if not isinstance(value, dict):
        raise MatrixError(f"{path}: missing table [{key}]")
    entry = _Entry(path, key, value)
    entry.only(*keys)
    return entry


def _rows(data: dict[str, Any], key: str, path: str, *keys: str, required: bool = True) -> list[_Entry]:
    rows = data.get(key, None if required else [])
    if not isinstance(rows, list) or (required and not rows):
        raise MatrixError(f"{path}: missing [[{key}]] rows")
    entries = []
    for number, row in enumerate(rows):
        if not isinstance(row, dict):
            raise MatrixError(f"{path}: {key}[{number}] must be a table")
        entry = _Entry(path, _label(key, number, row), row)
        entry.only(*keys)
        entries.append(entry)
    return entries


def _label(section: str, number: int, row: dict[str, Any]) -> str:
    """How an error names a row: by its name or variant where it has one, else by position."""
    name = row.get("spec") if section == "vllm" else row.get("name", row.get("variant"))
    if section == "flash_linear_attention":
        name = row.get("backend")
    if isinstance(name, str):
        return f"{section} {name!r}"
    family = row.get("family")
    if section == "support" and isinstance(family, (str, list)):
        return "support for " + (family if isinstance(family, str) else "/".join(map(str, family)))
    return f"{section}[{number}]"


def _unique(path: str, section: str, names: list[str]) -> None:
    for name in names:
        if names.count(name) > 1:
            raise MatrixError(f"{path}: {section} {name!r}: duplicate row")
