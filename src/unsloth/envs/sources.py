"""Where packages may come from: the user's pip configuration, overrides, and the torch source. Pure.

uv does not read pip's configuration, but users behind mirrors have one; we read it (through
``pip config list``) and pass the same indexes to uv as flags, which uv and pip both accept.
PyTorch-family packages never come from these general sources: they come from the plan's index,
or from a wheelhouse (find-links) holding exactly the build the plan asks for.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import unquote, urlparse

from packaging.requirements import Requirement
from packaging.utils import InvalidWheelFilename, parse_wheel_filename

# Packages that must come from the torch source, never from PyPI or a general mirror.
TORCH_FAMILY = frozenset(
    {"torch", "torchvision", "torchaudio", "triton", "pytorch-triton", "pytorch-triton-rocm", "pytorch-triton-xpu"}
)


@dataclass(frozen=True)
class Sources:
    """General package sources (everything but the PyTorch family)."""

    index_url: str | None = None  # None: PyPI
    extra_index_urls: tuple[str, ...] = ()
    find_links: tuple[str, ...] = ()
    constraints: tuple[str, ...] = ()
    no_index: bool = False
    cert: str | None = None
    timeout: str | None = None

    def args(self) -> list[str]:
        """Flags understood alike by ``uv pip install`` and ``pip install``."""
        out: list[str] = []
        if self.no_index:
            out.append("--no-index")
        if self.index_url:
            out += ["--index-url", self.index_url]
        for url in self.extra_index_urls:
            out += ["--extra-index-url", url]
        for link in self.find_links:
            out += ["--find-links", link]
        for path in self.constraints:
            out += ["--constraint", path]
        return out

    def env(self, inherited: Mapping[str, str]) -> dict[str, str | None]:
        """The environment of every install command: these sources and nothing else.

        pip would add its configuration files and PIP_* variables to our flags, and uv its UV_*
        index variables; both are already folded into these Sources, so they are switched off
        (None = unset) and only the certificate and timeout are passed on.
        """
        out: dict[str, str | None] = {name: None for name in inherited if name in _INDEX_VARIABLES}
        out.update(PIP_CONFIG_FILE=os.devnull, UV_NO_CONFIG="1")
        if self.cert:
            out.update(SSL_CERT_FILE=self.cert, PIP_CERT=self.cert)
        if self.timeout:
            out.update(UV_HTTP_TIMEOUT=self.timeout, PIP_DEFAULT_TIMEOUT=self.timeout)
        return out

    def to_json(self) -> dict:
        return {
            "index_url": self.index_url,
            "extra_index_urls": list(self.extra_index_urls),
            "find_links": list(self.find_links),
            "constraints": list(self.constraints),
            "no_index": self.no_index,
        }


# Variables through which pip or uv would take package sources we did not choose.
_INDEX_VARIABLES = frozenset(
    {f"PIP_{name}" for name in ("INDEX_URL", "EXTRA_INDEX_URL", "FIND_LINKS", "NO_INDEX", "CONSTRAINT", "CONFIG_FILE")}
    | {f"UV_{name}" for name in ("INDEX_URL", "EXTRA_INDEX_URL", "FIND_LINKS", "INDEX", "DEFAULT_INDEX", "NO_INDEX",
                                 "CONSTRAINT", "OVERRIDE", "INDEX_STRATEGY", "TORCH_BACKEND")}
)

# pip reads [global], then the command's own section, then PIP_* variables (shown as ":env:").
_SECTION_RANK = {"global": 0, "install": 1, ":env:": 2}
_KEYS = {"index-url", "extra-index-url", "find-links", "constraint", "no-index", "cert", "timeout", "default-timeout"}


def parse_pip_config(text: str) -> Sources:
    """``pip config list`` output -> Sources, with pip's own precedence."""
    found: dict[str, tuple[int, str]] = {}
    for line in text.splitlines():
        name, sep, raw = line.partition("=")
        section, dot, key = name.strip().rpartition(".")
        if not sep or not dot or section not in _SECTION_RANK or key not in _KEYS:
            continue
        try:
            value = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError):
            value = raw.strip().strip("'\"")
        rank = _SECTION_RANK[section]
        if key not in found or rank >= found[key][0]:
            found[key] = (rank, str(value))

    def words(key: str) -> tuple[str, ...]:
        return tuple(found[key][1].split()) if key in found else ()

    value = lambda key: found[key][1] if key in found else None  # noqa: E731
    return Sources(
        index_url=value("index-url"),
        extra_index_urls=words("extra-index-url"),
        find_links=words("find-links"),
        constraints=words("constraint"),
        no_index=(value("no-index") or "").lower() in {"1", "true", "yes", "on"},
        cert=value("cert"),
        timeout=value("timeout") or value("default-timeout"),
    )


def with_overrides(
    base: Sources,
    *,
    index_url: str | None = None,
    extra_index_urls: list[str] | None = None,
    find_links: list[str] | None = None,
) -> Sources:
    """Command-line / UNSLOTH_* overrides on top of the pip configuration."""
    sources = base
    if index_url:
        sources = replace(sources, index_url=index_url)
    if extra_index_urls:
        sources = replace(sources, extra_index_urls=sources.extra_index_urls + tuple(extra_index_urls))
    if find_links:
        sources = replace(sources, find_links=sources.find_links + tuple(find_links))
    return sources


@dataclass(frozen=True)
class TorchSource:
    """Where the PyTorch family comes from for one plan."""

    mode: str  # "index": only url; "wheelhouse": an exact build found in a find-links folder
    url: str | None
    requirements: tuple[str, ...]  # what to ask for, e.g. ("torch==2.13.0+cpu",)
    find_links: tuple[str, ...] = field(default=())

    def to_json(self) -> dict:
        return {"mode": self.mode, "url": self.url, "requirements": list(self.requirements)}


def _local_dir(link: str) -> Path | None:
    if "://" not in link:
        return Path(link)
    parsed = urlparse(link)
    return Path(unquote(parsed.path)) if parsed.scheme == "file" else None


def wheelhouse_torch(
    find_links: tuple[str, ...],
    variant: str | None,
    python_tag: str,
    listings: dict[str, list[str]],
    version_spec: str | None = None,
) -> tuple[str, str] | None:
    """The newest torch wheel in a local find-links folder built for ``variant`` and this Python.

    ``listings`` maps each folder to its file names (read by the caller), so this stays pure.
    Returns (folder, "torch==<version>") or None.
    """
    spec = Requirement(version_spec).specifier if version_spec else None
    best = None
    for link in find_links:
        for filename in listings.get(link, []):
            try:
                name, version, _build, tags = parse_wheel_filename(filename)
            except InvalidWheelFilename:
                continue
            if name != "torch" or (version.local or None) != variant:
                continue
            if not any(tag.interpreter in {python_tag, "py3"} for tag in tags):
                continue
            if spec is not None and not spec.contains(version, prereleases=True):
                continue
            if best is None or version > best[1]:
                best = (link, version)
    return (best[0], f"torch=={best[1]}") if best else None


def torch_source(
    plan_torch, sources: Sources, python_tag: str, listings: dict[str, list[str]], override_url: str | None = None
) -> TorchSource:
    """Pick the torch source: an explicit override, else a wheelhouse with the exact build, else the plan's index."""
    others = tuple(name for name in plan_torch.packages if name != "torch")
    wanted = (plan_torch.version_spec or "torch",) + others
    if override_url:
        return TorchSource("index", override_url, wanted)
    found = wheelhouse_torch(sources.find_links, plan_torch.variant, python_tag, listings, plan_torch.version_spec)
    if found and not others:
        folder, pin = found
        return TorchSource("wheelhouse", folder, (pin,), find_links=(folder,))
    return TorchSource("index", plan_torch.index_url, wanted)


def local_listings(find_links: tuple[str, ...]) -> dict[str, list[str]]:
    """File names in each local find-links folder (the one effect this module needs)."""
    out = {}
    for link in find_links:
        folder = _local_dir(link)
        if folder is not None and folder.is_dir():
            out[link] = sorted(path.name for path in folder.iterdir())
    return out


PYPI = "https://pypi.org/simple"


@dataclass(frozen=True)
class LlamaCppSource:
    """How the install step gets llama-cpp-python (envs/steps.py's llama_cpp_step)."""

    backend: str
    prebuilt_index: str | None  # tried first, alone; None: always a source build
    cmake_args: str  # for the source build from the package sources (the fallback after a prebuilt miss)

    def line(self) -> str:
        build = f"built from source (minutes) from the package sources, CMAKE_ARGS={self.cmake_args!r}"
        if self.prebuilt_index:
            return f"{self.backend}: prebuilt from {self.prebuilt_index}; where that index cannot serve it, {build}"
        return f"{self.backend}: {build}"

    def to_json(self) -> dict:
        return {"backend": self.backend, "prebuilt_index": self.prebuilt_index, "cmake_args": self.cmake_args}


@dataclass(frozen=True)
class InstallSources:
    """Where a real install on this machine takes each part from: what `install --dry-run` names."""

    packages: Sources  # everything but the PyTorch family (and llama.cpp's prebuilt wheel)
    packages_from: str  # why those: "your pip configuration", "--index-url", ...
    torch: TorchSource
    llama_cpp: LlamaCppSource | None  # None: left out (--without export or llama-cpp)

    def packages_line(self) -> str:
        where = "no index (--no-index)" if self.packages.no_index else (self.packages.index_url or f"PyPI ({PYPI})")
        more = ([f"extra index {url}" for url in self.packages.extra_index_urls]
                + [f"wheels in {link}" for link in self.packages.find_links]
                + [f"constraints {path}" for path in self.packages.constraints])
        return ", ".join([where, *more]) + f" ({self.packages_from})"

    def torch_line(self) -> str:
        wanted = " ".join(self.torch.requirements)
        if self.torch.mode == "wheelhouse":
            return f"{wanted} from the wheelhouse {self.torch.url} (it holds the plan's exact build)"
        return f"{wanted} from {self.torch.url}"

    def to_json(self) -> dict:
        return {"packages": {**self.packages.to_json(), "from": self.packages_from}, "torch": self.torch.to_json(),
                "llama_cpp": self.llama_cpp.to_json() if self.llama_cpp else None}


def install_sources(plan, sources: Sources, packages_from: str, python_tag: str, listings: dict[str, list[str]],
                    torch_index_url: str | None, without: tuple[str, ...]) -> InstallSources:
    """The sources the build steps will use for this plan (the same choices as envs/build.py's)."""
    torch = torch_source(plan.torch, sources, python_tag, listings, torch_index_url)
    llama = plan.llama_cpp
    prebuilt = llama.index_url if llama.how == "wheel" else None
    left_out = bool({"export", "llama-cpp"} & set(without))
    return InstallSources(sources, packages_from, torch,
                          None if left_out else LlamaCppSource(llama.backend, prebuilt, llama.cmake_args))
