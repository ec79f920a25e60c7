"""The install, as a list of commands. Pure: the plan and the request in, argv lists out.

Order (each later step pins what the earlier ones installed, so nothing replaces them):
1. the PyTorch family, from the torch source only (the plan's index, or a wheelhouse with that exact build);
2. this package with its ``train`` extra, bitsandbytes where the plan has it, and vLLM where the plan
   has it (`--with vllm`: resolved together, so transformers fits both), from the general sources
   (PyPI or the configured mirror), torch pinned by a constraints file;
3. the ``export`` extra but llama-cpp-python;
4. llama-cpp-python, from the plan's prebuilt wheel index alone (then its dependencies) or built
   with the plan's CMAKE_ARGS (unless left out), in a build cache of its own per plan (below);
5. flash-linear-attention where the plan has it, from the general sources, with everything installed
   so far pinned: an accelerator may add itself (and fla-core, einops) but change nothing, so where
   it does not fit it fails, and the build goes on without it (optional, as llama.cpp).

uv and pip key a wheel they built from an sdist by the sdist alone, not by CMAKE_ARGS: with one cache,
a llama-cpp-python built for the CPU would be installed again for a CUDA plan. So the source build gets
its own uv / pip cache folder, named by the plan facts that change the binary (backend, CMAKE_ARGS with
the GPU targets in them); inside it the tools key by version and Python as usual. The same plan again
(`update`, `install --force`) reuses the wheel instead of compiling for minutes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement

from unsloth.envs.runner import Step
from unsloth.plan import BitsAndBytes, FlashLinearAttention, LlamaCpp, Vllm
from unsloth.envs.sources import Sources, TorchSource

DIST_NAME = "unsloth-installer"  # ours; PyPI's `unsloth` is another project and is never asked for
OPTIONAL_PARTS = ("llama-cpp", "export", "bitsandbytes", "fla", "train")  # "fla": flash-linear-attention


@dataclass(frozen=True)
class Tool:
    """How to run installs: ``uv pip install --python P`` or ``P -m pip install``."""

    name: str  # "uv" | "pip"
    install: tuple[str, ...]

    @classmethod
    def uv(cls, uv: str, python: Path) -> "Tool":
        return cls("uv", (uv, "pip", "install", "--python", str(python)))

    @classmethod
    def pip(cls, python: Path) -> "Tool":
        return cls("pip", (str(python), "-m", "pip", "install", "--disable-pip-version-check"))


@dataclass(frozen=True)
class Request:
    """What the user asked for; with the plan, it decides everything the build does."""

    source: str  # a directory or archive URL of this project
    sources: Sources = field(default_factory=Sources)
    without: tuple[str, ...] = ()
    torch_index_url: str | None = None  # overrides the plan's index (a mirror of it)
    python: str | None = None
    with_parts: tuple[str, ...] = ()  # opt-in parts (`--with vllm`)

    def to_json(self) -> dict[str, Any]:
        data = {
            "source": self.source,
            "sources": self.sources.to_json(),
            "without": sorted(self.without),
            "torch_index_url": self.torch_index_url,
            "python": self.python,
        }
        if self.with_parts:  # only then: a request without it hashes as it always did
            data["with"] = sorted(self.with_parts)
        return data


def is_local_source(source: str) -> bool:
    return "://" not in source or source.startswith("file://")


def torch_step(tool: Tool, torch: TorchSource, sources: Sources, backend: str) -> Step:
    if torch.mode == "index":
        # Only the torch index: PyTorch's indexes carry torch's own dependencies too.
        where = ["--index-url", torch.url or ""] + [arg for c in sources.constraints for arg in ("--constraint", c)]
        title = f"PyTorch ({backend}) from {torch.url}"
    else:
        where = sources.args() + [arg for link in torch.find_links if link not in sources.find_links for arg in ("--find-links", link)]
        title = f"PyTorch ({backend}) from the wheelhouse {torch.url}"
    return Step("torch", title, [*tool.install, *where, *torch.requirements])


def pins_text(installed: dict[str, str], names: frozenset[str]) -> str:
    """Constraints that keep the installed PyTorch family exactly as it is."""
    return "".join(f"{name}=={installed[name]}\n" for name in sorted(names) if name in installed)


def bitsandbytes_requirement(plan_bnb: BitsAndBytes) -> str | None:
    if not plan_bnb.available:
        return None
    return plan_bnb.spec or "bitsandbytes"


def packages_step(tool: Tool, request: Request, pins: Path, plan_bnb: BitsAndBytes,
                  plan_vllm: Vllm | None = None) -> Step:
    extras = "" if "train" in request.without else "[train]"
    requirements = [f"{DIST_NAME}{extras} @ {_as_url(request.source)}"]
    bnb = bitsandbytes_requirement(plan_bnb)
    if bnb and plan_bnb.source == "pypi" and "bitsandbytes" not in request.without:
        requirements.append(bnb)
    if plan_vllm is not None and plan_vllm.available and plan_vllm.spec:
        requirements.append(plan_vllm.spec)  # its torch pin is the plan's torch, installed in step 1
    refresh = ["--reinstall-package", DIST_NAME] if tool.name == "uv" and is_local_source(request.source) else []
    argv = [*tool.install, *request.sources.args(), "--constraint", str(pins), *refresh, *requirements]
    return Step("packages", "unsloth, transformers, PEFT, TRL and the rest", argv)


def export_step(tool: Tool, request: Request, pins: Path, export_requires: list[str]) -> Step | None:
    """The ``export`` extra (read from the installed package's metadata) but llama-cpp-python."""
    if "export" in request.without:
        return None
    wanted = []
    for text in export_requires:
        req = Requirement(text)
        if req.name != "llama-cpp-python":
            req.marker = None  # the `extra == "export"` marker is what selected it
            wanted.append(str(req))
    if not wanted:
        return None
    argv = [*tool.install, *request.sources.args(), "--constraint", str(pins), *wanted]
    return Step("export", "GGUF export tools", argv)


def built_wheel_key(plan_llama: LlamaCpp) -> str:
    """The build cache folder of a llama-cpp-python source build: its backend and a digest of the facts
    that change the binary."""
    facts = json.dumps({"backend": plan_llama.backend, "cmake_args": plan_llama.cmake_args}, sort_keys=True)
    return f"{plan_llama.backend}-{hashlib.sha256(facts.encode()).hexdigest()[:12]}"


def built_wheel_caches(cache: Path, plan_llama: LlamaCpp) -> dict[str, str]:
    """uv's and pip's cache folders for the source build of ``plan_llama``, under ``cache`` (<home>/cache)."""
    folder = cache / "llama-cpp" / built_wheel_key(plan_llama)
    return {"UV_CACHE_DIR": str(folder / "uv"), "PIP_CACHE_DIR": str(folder / "pip")}


def llama_cpp_step(tool: Tool, request: Request, pins: Path, export_requires: list[str], plan_llama: LlamaCpp,
                   *, cache: Path, prebuilt: bool = True) -> Step | None:
    """llama-cpp-python as the plan says: from its prebuilt wheel index only (its dependencies follow in
    `llama_cpp_deps_step`), or built from source with the plan's CMAKE_ARGS (also the fallback, with
    ``prebuilt=False``, when that index cannot serve it), in the plan's own build cache under ``cache``."""
    req = _llama_requirement(request, export_requires)
    if req is None:
        return None
    backend = plan_llama.backend
    if prebuilt and plan_llama.how == "wheel" and plan_llama.index_url:
        # That index alone, so no other index can supply a package of the same name (uv and pip alike).
        argv = [*tool.install, "--index-url", plan_llama.index_url, "--no-deps", "--only-binary", "llama-cpp-python",
                "--constraint", str(pins), str(req)]
        return Step("llama-cpp", f"llama-cpp-python ({backend}, prebuilt) from {plan_llama.index_url}", argv)
    env = {"CMAKE_ARGS": plan_llama.cmake_args, **built_wheel_caches(cache, plan_llama)}
    # --verbose: the build backend's output (cmake's "[ 42%] Building ...") reaches the log and the
    # progress line, instead of minutes of silence.
    argv = [*tool.install, "--verbose", *request.sources.args(), "--no-binary", "llama-cpp-python", "--constraint",
            str(pins), str(req)]
    return Step("llama-cpp", f"llama-cpp-python ({backend}), built from source (minutes)", argv, env=env)


def llama_cpp_deps_step(tool: Tool, request: Request, pins: Path, export_requires: list[str]) -> Step | None:
    """The prebuilt llama-cpp-python's own dependencies, from the general sources; it is pinned in ``pins``."""
    req = _llama_requirement(request, export_requires)
    if req is None:
        return None
    argv = [*tool.install, *request.sources.args(), "--constraint", str(pins), str(req)]
    return Step("llama-cpp-deps", "llama-cpp-python's dependencies", argv)


def fla_step(tool: Tool, request: Request, pins_all: Path, plan_fla: FlashLinearAttention | None) -> Step | None:
    """flash-linear-attention, where the plan has it and it is not left out (--without fla). ``pins_all``
    pins every package installed before it (`pins_text` of them all), so it changes none of them."""
    if plan_fla is None or not plan_fla.available or not plan_fla.spec or "fla" in request.without:
        return None
    argv = [*tool.install, *request.sources.args(), "--constraint", str(pins_all), plan_fla.spec]
    return Step("fla", "flash-linear-attention (Qwen3.5's linear-attention kernels)", argv)


def _llama_requirement(request: Request, export_requires: list[str]) -> Requirement | None:
    if {"export", "llama-cpp"} & set(request.without):
        return None
    spec = next((text for text in export_requires if Requirement(text).name == "llama-cpp-python"), None)
    if spec is None:
        return None
    req = Requirement(spec)
    req.marker = None
    return req


def _as_url(source: str) -> str:
    if "://" in source:
        return source
    return Path(source).absolute().as_uri()
