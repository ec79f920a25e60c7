"""Load hardware_matrix.toml and validate it into typed tables.

The matrix is data users may edit (UNSLOTH_MATRIX points at their copy), so every mistake is
reported as a MatrixError naming the file, the entry and what is wrong, never as a KeyError deep
inside the planner.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

SCHEMA = 1
LEVELS = ("full", "limited", "unsupported")
VENDORS = ("nvidia", "amd", "intel", "apple", "none")
BACKENDS = ("cuda", "rocm", "mps", "cpu", "vulkan")
LLAMA_BACKENDS = ("cuda", "hip", "vulkan", "metal", "cpu")
REQUIRED_URLS = ("pytorch", "pypi", "amd", "llama_cpp_wheels", "rocm_install", "rocm_wsl", "nvidia_driver")
ENV_VAR = "UNSLOTH_MATRIX"


class MatrixError(ValueError):
    """The matrix file is missing, unparsable, or an entry in it is wrong."""


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

    def family_of(self, arch: str) -> Family | None:
        for family in self.families.values():
            if arch in family.archs:
                return family
        return None

    def cell(self, family: str, os_name: str) -> SupportCell:
        return self.support[(family, os_name)]


def default_path() -> Path:
    """The packaged matrix (src/unsloth/hardware_matrix.toml links to the repository's copy)."""
    return Path(__file__).with_name("hardware_matrix.toml")


def load_matrix(path: str | os.PathLike[str] | None = None) -> Matrix:
    """Read and validate the matrix: `path`, else $UNSLOTH_MATRIX, else the packaged file."""
    chosen = Path(path or os.environ.get(ENV_VAR) or default_path())
    try:
        text = chosen.read_text(encoding="utf-8")
    except OSError as exc:
        hint = f" (set by {ENV_VAR})" if not path and os.environ.get(ENV_VAR) else ""
        raise MatrixError(f"{chosen}{hint}: cannot read the hardware matrix: {exc.strerror or exc}") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise MatrixError(f"{chosen}: not valid TOML: {exc}") from exc
    return parse_matrix(data, str(chosen))


def parse_matrix(data: dict[str, Any], path: str = "<matrix>") -> Matrix:
    """Validate already-parsed TOML data. Pure; raises MatrixError naming the first bad entry."""
    if data.get("schema") != SCHEMA:
        raise MatrixError(f"{path}: schema = {data.get('schema')!r}, this unsloth reads schema = {SCHEMA}")
    oses = tuple(_str_list(_Entry(path, "oses", {"oses": data.get("oses")}), "oses"))
    if not oses:
        raise MatrixError(f"{path}: 'oses' must list at least one OS")

    urls_entry = _Entry(path, "urls", _table(data, "urls", path))
    urls_entry.only(*REQUIRED_URLS, "source")
    urls = {name: _url(urls_entry, name) for name in REQUIRED_URLS}
    sources = {"urls": urls_entry.source()}

    families: dict[str, Family] = {}
    for entry in _rows(data, "family", path):
        name = entry.text("name")
        entry.label = f"family {name!r}"
        entry.only("name", "vendor", "archs", "products", "source", "hsa_override", "amd_index")
        if name in families:
            raise entry.error("duplicate family")
        archs = tuple(entry.str_list("archs"))
        overrides = entry.str_map("hsa_override", required=False)
        amd_index = entry.str_map("amd_index", required=False)
        for arch in [*overrides, *amd_index]:
            if arch not in archs:
                raise entry.error(f"arch {arch!r} is not in its archs {list(archs)}")
        for arch, value in overrides.items():
            _version(entry, f"hsa_override.{arch}", value)
        families[name] = Family(
            name=name,
            vendor=entry.choice("vendor", VENDORS),
            archs=archs,
            products=entry.text("products"),
            source=entry.source(),
            hsa_override=overrides,
            amd_index=amd_index,
        )
    seen_arch: dict[str, str] = {}
    for family in families.values():
        for arch in family.archs:
            if arch in seen_arch:
                raise MatrixError(f"{path}: family {family.name!r}: arch {arch!r} is also in family {seen_arch[arch]!r}")
            seen_arch[arch] = family.name

    support: dict[tuple[str, str], SupportCell] = {}
    for entry in _rows(data, "support", path):
        names = entry.str_or_list("family")
        entry.label = f"support for {'/'.join(names)}"
        entry.only("family", "os", "level", "reason", "source")
        cell_oses = entry.oses(oses)
        level = entry.choice("level", LEVELS)
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

    cuda_indexes = []
    for entry in _rows(data, "cuda_index", path):
        variant = entry.text("variant")
        entry.label = f"cuda_index {variant!r}"
        entry.only("variant", "cuda", "driver", "sm", "torch", "source")
        drivers = entry.str_map("driver")
        if set(drivers) != {"linux", "windows"}:
            raise entry.error(f"driver must give exactly 'linux' and 'windows', got {sorted(drivers)}")
        cuda_indexes.append(
            CudaIndex(
                variant=variant,
                cuda=entry.version("cuda"),
                driver={key: _version(entry, f"driver.{key}", value) for key, value in drivers.items()},
                sm=entry.version_range("sm"),
                torch=entry.specifier("torch"),
                source=entry.source(),
            )
        )
    _unique(path, "cuda_index", [index.variant for index in cuda_indexes])

    rocm_indexes = []
    for entry in _rows(data, "rocm_index", path):
        variant = entry.text("variant")
        entry.label = f"rocm_index {variant!r}"
        entry.only("variant", "rocm", "archs", "torch", "source")
        rocm_indexes.append(
            RocmIndex(
                variant=variant,
                rocm=entry.version("rocm"),
                archs=frozenset(entry.archs("archs", seen_arch)),
                torch=entry.specifier("torch"),
                source=entry.source(),
            )
        )
    _unique(path, "rocm_index", [index.variant for index in rocm_indexes])

    bitsandbytes = []
    for number, entry in enumerate(_rows(data, "bitsandbytes", path)):
        entry.label = f"bitsandbytes[{number}]"
        entry.only("backend", "os", "spec", "sm", "archs", "source")
        spec = entry.text("spec")
        try:
            Requirement(spec)
        except InvalidRequirement as exc:
            raise entry.error(f"spec {spec!r} is not a requirement: {exc}") from exc
        bitsandbytes.append(
            BitsandbytesRow(
                backend=entry.choice("backend", BACKENDS),
                oses=entry.oses(oses),
                spec=spec,
                source=entry.source(),
                sm=entry.version_range("sm") if "sm" in entry.data else None,
                archs=frozenset(entry.archs("archs", seen_arch)) if "archs" in entry.data else None,
            )
        )

    llama_cpp = []
    for number, entry in enumerate(_rows(data, "llama_cpp", path)):
        entry.label = f"llama_cpp[{number}]"
        entry.only("backend", "os", "wheel", "wheel_archs", "cmake_args", "source")
        llama_cpp.append(
            LlamaCppRow(
                backend=entry.choice("backend", LLAMA_BACKENDS),
                oses=entry.oses(oses),
                wheel=entry.str_map("wheel"),
                cmake_args=entry.text("cmake_args", allow_empty=True),
                source=entry.source(),
                wheel_archs=frozenset(entry.archs("wheel_archs", seen_arch)) if "wheel_archs" in entry.data else None,
            )
        )

    env = []
    for number, entry in enumerate(_rows(data, "env", path, required=False)):
        entry.label = f"env[{number}]"
        entry.only("backend", "os", "vars", "source")
        env.append(EnvRow(entry.choice("backend", BACKENDS), entry.oses(oses), entry.str_map("vars"), entry.source()))

    amd_entry = _Entry(path, "amd_wheels", _table(data, "amd_wheels", path))
    amd_entry.only("torch", "source")
    amd_torch = amd_entry.specifier("torch")
    sources["amd_wheels"] = amd_entry.source()

    attention_entry = _Entry(path, "attention", _table(data, "attention", path))
    attention = {key: value for key, value in attention_entry.str_map_all().items() if key != "source"}
    for backend in attention:
        if backend not in BACKENDS:
            raise attention_entry.error(f"unknown torch backend {backend!r}; known: {', '.join(BACKENDS)}")
    sources["attention"] = attention_entry.source()

    fits_entry = _Entry(path, "fits", _table(data, "fits", path))
    fits_entry.only(*(f.name for f in dataclasses.fields(Fits)))
    fits = Fits(
        qlora_bytes_per_param=fits_entry.number("qlora_bytes_per_param"),
        lora16_bytes_per_param=fits_entry.number("lora16_bytes_per_param"),
        overhead=fits_entry.number("overhead"),
        fixed_gib=fits_entry.number("fixed_gib"),
        model_sizes_b=tuple(fits_entry.number_list("model_sizes_b")),
        source=fits_entry.source(),
    )

    return Matrix(
        path=path,
        oses=oses,
        urls=urls,
        families=families,
        support=support,
        cuda_indexes=tuple(cuda_indexes),
        rocm_indexes=tuple(rocm_indexes),
        bitsandbytes=tuple(bitsandbytes),
        llama_cpp=tuple(llama_cpp),
        env=tuple(env),
        amd_torch=amd_torch,
        attention=attention,
        fits=fits,
        sources=sources,
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

    def str_map_all(self) -> dict[str, str]:
        for key, value in self.data.items():
            if not isinstance(value, str):
                raise self.error(f"'{key}' must be a string, got {value!r}")
        return dict(self.data)

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


def _table(data: dict[str, Any], key: str, path: str) -> dict[str, Any]:
    value = data.get(key)
    if not isinstance(value, dict):
        raise MatrixError(f"{path}: missing table [{key}]")
    return value


def _rows(data: dict[str, Any], key: str, path: str, *, required: bool = True) -> list[_Entry]:
    rows = data.get(key, [] if not required else None)
    if not isinstance(rows, list) or (required and not rows):
        raise MatrixError(f"{path}: missing [[{key}]] rows")
    entries = []
    for number, row in enumerate(rows):
        if not isinstance(row, dict):
            raise MatrixError(f"{path}: {key}[{number}] must be a table")
        entries.append(_Entry(path, f"{key}[{number}]", row))
    return entries


def _unique(path: str, section: str, names: list[str]) -> None:
    for name in names:
        if names.count(name) > 1:
            raise MatrixError(f"{path}: {section} {name!r}: duplicate row")
