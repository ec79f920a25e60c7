"""The machine checks: small pure functions from facts (Platform, Plan, HostFacts) to a Finding.

Each check returns None when it does not apply here (no WSL check off WSL), and a "skipped"
Finding when it applies but its facts are missing (HostFacts of a dump from another machine).
"""

from __future__ import annotations

import re
import traceback
from dataclasses import dataclass, field

from packaging.version import Version

from unsloth.doctor.findings import Finding
from unsloth.doctor.host import HostFacts
from unsloth.envs.paths import ENV_DISK_GIB
from unsloth.errors import UnslothError
from unsloth.matrix import Matrix
from unsloth.platform.facts import Gpu, Platform
from unsloth.platform.parsers.gpu_topology import DESCRIPTIONS, parse_nvidia_topo, parse_rocm_topo
from unsloth.plan import Plan, support_phrase, version_or_none
from unsloth.selftest.judge import backend, target_gpu

GIB = 2**30
MIN_RAM_GIB = 8  # tokenizer, dataset and the model's CPU copy during load; below this loads swap
WORK_DISK_GIB = 5  # with the environment installed: a model download and a checkpoint
GROUP_FIX = "sudo usermod -aG render,video $USER   # then log out and back in"
NOT_LIVE = "checked only on the live machine, not on a dump"


@dataclass(frozen=True)
class Needs:
    """What the plan needs from the machine, looked up in the hardware matrix (see needs_from_matrix)."""

    nvidia_driver: str | None = None  # minimum driver for the plan's CUDA build on this OS (else the oldest build's)
    rocm: str | None = None  # the ROCm release the plan's torch wheels bundle
    urls: dict[str, str] = field(default_factory=dict)  # the matrix's [urls]: driver and ROCm install pages


def needs_from_matrix(matrix: Matrix, platform: Platform, plan: Plan | None) -> Needs:
    if plan is None:
        return Needs(urls=dict(matrix.urls))
    # Under WSL nvidia-smi reports the Windows host driver, so the Windows minimum applies.
    driver_os = "windows" if platform.os == "windows" or platform.wsl else "linux"
    minima = {row.variant: row.driver[driver_os] for row in matrix.cuda_indexes if driver_os in row.driver}
    # A plan without CUDA (the driver too old for every build, say) is held to the oldest build's minimum.
    driver = minima.get(plan.torch.variant) or (min(minima.values()) if minima else None)
    rocm = next((row.rocm for row in matrix.rocm_indexes if row.variant == plan.torch.variant), None)
    return Needs(nvidia_driver=driver and str(driver), rocm=rocm and str(rocm), urls=dict(matrix.urls))


def _gib(n: int) -> str:
    return f"{n / GIB:.0f} GiB"


def describe_gpu(gpu: Gpu) -> str:
    facts = [gpu.arch, _gib(gpu.vram_bytes) if gpu.vram_bytes else None, "integrated" if gpu.integrated else None]
    extra = ", ".join(f for f in facts if f)
    return f"{gpu.name or gpu.vendor.upper() + ' GPU'}" + (f" ({extra})" if extra else "")


def check_gpu(platform: Platform, plan: Plan | None) -> Finding:
    title = "GPU"
    if not platform.gpus:
        return Finding(
            "gpu", title, "warning", "No GPU found: training will run on the CPU (slow)",
            fix="If this machine has a GPU, install its driver (NVIDIA: `nvidia-smi` must work; "
            "AMD: the amdgpu driver), then run `unsloth doctor` again",
        )
    if plan is not None and plan.device is None:
        return Finding(
            "gpu", title, "warning",
            f"{len(platform.gpus)} GPU(s) found, none usable: {plan.device_reason}; training will run on the CPU (slow)",
            fix=next((w.fix for w in plan.warnings if w.fix), None),
        )
    gpu = target_gpu(platform, plan)
    others = len(platform.gpus) - 1
    return Finding("gpu", title, "ok", describe_gpu(gpu) + (f" (+{others} more)" if others else ""))


def check_support(plan: Plan | None, plan_error: Exception | str | None = None) -> Finding:
    """``plan_error``: why there is no plan; an UnslothError (an unreadable matrix) brings its own fix."""
    title = "Support"
    if plan is None:
        problem, fix, detail = str(plan_error), None, ""
        if isinstance(plan_error, UnslothError):  # an unreadable matrix: its own fix
            problem, fix = plan_error.problem, plan_error.fix
        elif isinstance(plan_error, Exception):  # a crash in the planner: a bug, with its traceback
            problem = f"{type(plan_error).__name__}: {plan_error}"
            detail = "".join(traceback.format_exception(plan_error)).rstrip()
        return Finding("support", title, "error", f"No install plan: {problem}".replace("\n", " "), required=True,
                       fix=fix or "Report this with `unsloth doctor --dump ./unsloth-dump` attached", detail=detail)
    if plan.support == "full":
        return Finding("support", title, "ok", f"Fully supported: {plan.reason}")
    fix = next((w.fix for w in plan.warnings if w.fix), None)
    return Finding("support", title, "warning", f"{support_phrase(plan.support).capitalize()}: {plan.reason}", fix=fix)


def check_plan_advice(plan: Plan | None, covered: set[str] | frozenset[str] = frozenset()) -> list[Finding]:
    """The plan's own warnings (a wheel that lacks this arch, a pinned index), as findings. Advice
    about a fact one of doctor's checks judged itself (``covered``: their ids) is left out, so the
    report says each thing once; ``Advice.check`` names that check where the plan sets it."""
    if plan is None:
        return []
    return [
        Finding(f"plan-advice-{n}", "Install plan", "warning", advice.message, fix=advice.fix)
        for n, advice in enumerate(plan.warnings, 1)
        if advice.check not in covered
    ]


def check_driver(platform: Platform, plan: Plan | None, needs: Needs) -> Finding | None:
    """NVIDIA: the driver is at least what the plan's CUDA build needs. AMD: the kernel driver is loaded."""
    gpu = target_gpu(platform, plan)
    if gpu is None:
        return None
    title = "GPU driver"
    if gpu.vendor == "nvidia":
        where = " on Windows (not inside WSL)" if platform.wsl else ""
        page = needs.urls.get("nvidia_driver")
        from_page = f" from {page}" if page else ""
        minimum = needs.nvidia_driver
        if platform.nvidia_driver is None:
            if any(status == "ok" for name, status in platform.probes.items() if name.startswith("nvidia-smi")):
                return Finding("driver", title, "skipped", "nvidia-smi answered but did not show the driver version")
            at_least = f" ({minimum} or newer)" if minimum else ""
            return Finding("driver", title, "error", "NVIDIA GPU found but no driver answered (nvidia-smi)",
                           fix=f"Install the NVIDIA driver{at_least}{where}{from_page}, reboot, and check that "
                           "`nvidia-smi` works", required=backend(plan) == "cuda")
        have, need = version_or_none(platform.nvidia_driver), version_or_none(minimum)
        cuda_plan = backend(plan) == "cuda"
        needer = f"torch {plan.torch.variant}" if cuda_plan else "the oldest PyTorch CUDA build"
        if need is not None and have is not None and have < need:
            consequence = "" if cuda_plan else ": training runs on the CPU"
            return Finding("driver", title, "error" if cuda_plan else "warning",
                           f"NVIDIA driver {platform.nvidia_driver} is older than {minimum}, which {needer} "
                           f"needs{consequence}",
                           fix=f"Update the NVIDIA driver{where} to {minimum} or newer{from_page}, then reboot",
                           required=cuda_plan)
        needed = f" ({needer} needs {minimum})" if minimum else ""
        return Finding("driver", title, "ok", f"NVIDIA driver {platform.nvidia_driver}{needed}")
    if gpu.vendor == "amd" and platform.os == "linux" and not platform.wsl:
        if platform.dev_kfd is False:
            page = needs.urls.get("rocm_install", "AMD's ROCm install guide")
            return Finding("driver", title, "error", "The amdgpu kernel driver is not loaded (no /dev/kfd)",
                           fix=f"Install AMD's GPU driver (`sudo amdgpu-install --usecase=dkms`, see {page}), "
                           "then reboot", required=backend(plan) == "rocm")
        if platform.dev_kfd:
            return Finding("driver", title, "ok", "amdgpu kernel driver loaded (/dev/kfd present)")
    return None


def _cuda_of(variant: str | None) -> Version | None:
    match = re.fullmatch(r"cu(\d+)(\d)", variant or "")
    return Version(f"{match[1]}.{match[2]}") if match else None


def check_runtime(platform: Platform, plan: Plan | None, needs: Needs) -> Finding | None:
    """The GPU runtime under the plan's torch build: CUDA through the driver, ROCm on the system."""
    if plan is None or plan.torch.backend not in ("cuda", "rocm"):
        return None
    title = "GPU runtime"
    build = plan.torch.variant
    if plan.torch.backend == "cuda":
        wanted, have = _cuda_of(build), version_or_none(platform.cuda_driver)
        if have is None:
            return Finding("runtime", title, "skipped", "The driver did not say which CUDA version it supports")
        # CUDA minor-version compatibility: a driver for CUDA 12.x runs every 12.y build.
        if wanted is not None and have.major < wanted.major:
            return Finding("runtime", title, "error",
                           f"The driver supports CUDA {platform.cuda_driver}; torch {build} needs CUDA {wanted.major}",
                           fix="Update the NVIDIA driver, or run `unsloth install` again to pick a build for this driver",
                           required=True)
        return Finding("runtime", title, "ok", f"The driver supports CUDA {platform.cuda_driver}; torch {build}")
    if platform.os == "windows":
        return None  # AMD's Windows wheels carry the whole runtime (rocm_sdk); the driver is Adrenalin
    guide = needs.urls.get("rocm_wsl" if platform.wsl else "rocm_install", "AMD's ROCm install guide")
    if platform.rocm_version is None:
        if platform.wsl:  # torch's bundled runtime reaches the GPU only through ROCm's WSL bridge
            return Finding("runtime", title, "error", "No ROCm found: under WSL the GPU is reached through it",
                           fix=f"Install ROCm for WSL and set HSA_ENABLE_DXG_DETECTION=1: {guide}", required=True)
        # Not needed to train: the torch wheels bring their own ROCm (the plan's advice says when to add it).
        return Finding("runtime", title, "skipped", "No system ROCm to check; torch brings its own")
    if needs.rocm and version_or_none(platform.rocm_version) and version_or_none(platform.rocm_version) < version_or_none(needs.rocm):
        return Finding("runtime", title, "warning",
                       f"ROCm {platform.rocm_version} is older than {needs.rocm}, which torch {build} bundles "
                       "(kernel driver and runtime should be at most a year apart)",
                       fix=f"Update ROCm to {needs.rocm} or newer: {guide}")
    return Finding("runtime", title, "ok", f"ROCm {platform.rocm_version}; torch {build}")


def _amd_native_linux(platform: Platform, plan: Plan | None) -> bool:
    gpu = target_gpu(platform, plan)
    return gpu is not None and gpu.vendor == "amd" and platform.os == "linux" and not platform.wsl


def _access_finding(check_id: str, title: str, node_desc: str, group: str | None, host: HostFacts,
                    required: bool) -> Finding:
    group = group or "render"
    if group in host.member_of and group not in host.groups:
        return Finding(check_id, title, "error",
                       f"{host.user} was added to group {group}, but this login session predates it",
                       fix=f"Log out and back in (or run `newgrp {group}`)", required=required)
    return Finding(check_id, title, "error",
                   f"No read/write access to {node_desc} (group {group}); {host.user} is in: {', '.join(host.groups) or 'none'}",
                   fix=GROUP_FIX, required=required)


def check_kfd_access(platform: Platform, plan: Plan | None, host: HostFacts | None) -> Finding | None:
    """ROCm opens /dev/kfd for compute; without access torch sees no GPU."""
    if not _amd_native_linux(platform, plan) or platform.dev_kfd is False:
        return None  # no /dev/kfd at all is the driver check's finding
    title = "/dev/kfd access"
    if host is None:
        return Finding("dev-kfd", title, "skipped", NOT_LIVE)
    if host.kfd is None:
        return Finding("dev-kfd", title, "error", "/dev/kfd does not exist: the amdgpu driver is not loaded",
                       fix="sudo modprobe amdgpu   # or install it: sudo amdgpu-install --usecase=dkms",
                       required=backend(plan) == "rocm")
    if not host.kfd.accessible:
        return _access_finding("dev-kfd", title, "/dev/kfd", host.kfd.group, host, backend(plan) == "rocm")
    return Finding("dev-kfd", title, "ok", f"/dev/kfd is readable and writable (group {host.kfd.group})")


def check_dri_access(platform: Platform, plan: Plan | None, host: HostFacts | None) -> Finding | None:
    """ROCm also needs the GPU's render node (/dev/dri/renderD*)."""
    if not _amd_native_linux(platform, plan):
        return None
    title = "/dev/dri access"
    if host is None:
        return Finding("dev-dri", title, "skipped", NOT_LIVE)
    required = backend(plan) == "rocm"
    if not host.render_nodes:
        return Finding("dev-dri", title, "error", "No /dev/dri/renderD* nodes: the amdgpu driver is not loaded",
                       fix="sudo modprobe amdgpu   # or install it: sudo amdgpu-install --usecase=dkms", required=required)
    blocked = [node for node in host.render_nodes if not node.accessible]
    if blocked:
        paths = ", ".join(node.path for node in blocked)
        return _access_finding("dev-dri", title, paths, blocked[0].group, host, required)
    return Finding("dev-dri", title, "ok", f"{len(host.render_nodes)} render node(s) accessible")


def check_wsl_bridge(platform: Platform, plan: Plan | None, host: HostFacts | None) -> Finding | None:
    """Under WSL the GPU comes from Windows through /dev/dxg and the libraries in /usr/lib/wsl/lib."""
    if not platform.wsl:
        return None
    title = "WSL GPU bridge"
    required = backend(plan) in ("cuda", "rocm")
    if platform.wsl_version == 1:
        return Finding("wsl-bridge", title, "error", "WSL 1 cannot use the GPU",
                       fix="In Windows PowerShell: wsl --set-version <distro> 2", required=required)
    update = "In Windows PowerShell: wsl --update; install the current GPU driver on Windows; then wsl --shutdown and reopen"
    if platform.dev_dxg is False:
        return Finding("wsl-bridge", title, "error", "/dev/dxg is missing: Windows is not sharing a GPU with WSL",
                       fix=update, required=required)
    if host is None:
        return Finding("wsl-bridge", title, "skipped", NOT_LIVE)
    if not host.wsl_lib_dir:
        return Finding("wsl-bridge", title, "error", "/usr/lib/wsl/lib is missing: no GPU libraries from Windows",
                       fix=update, required=required)
    return Finding("wsl-bridge", title, "ok", "/dev/dxg and /usr/lib/wsl/lib present")


def _unset_fix(host: HostFacts | None) -> str:
    where = (", ".join(f"{line.path} line {line.lineno} (`{line.text}`)" for line in host.rc_overrides)
             if host is not None and host.rc_overrides else "~/.bashrc (or wherever you set it)")
    return f"unset HSA_OVERRIDE_GFX_VERSION   # and delete it from {where}"


def check_hsa_override(platform: Platform, plan: Plan | None, host: HostFacts | None) -> Finding | None:
    """A hand-set HSA_OVERRIDE_GFX_VERSION makes ROCm treat the GPU as another chip: right only when the plan says so."""
    wanted = plan.env.get("HSA_OVERRIDE_GFX_VERSION") if plan is not None else None
    have = platform.hsa_override
    if have is None:
        return None  # the managed environment sets the plan's value itself
    title = "HSA_OVERRIDE_GFX_VERSION"
    per_node = sorted(k for k in (plan.env if plan is not None else {}) if k.startswith("HSA_OVERRIDE_GFX_VERSION_"))
    if per_node:
        return Finding("hsa-override", title, "error",
                       f"Set to {have} for every AMD GPU, but they are of different targets: only the training GPU "
                       f"needs it ({per_node[0]}={plan.env[per_node[0]]}, which the managed environment sets)",
                       fix=_unset_fix(host), required=True)
    if wanted is not None:
        if have == wanted:
            return Finding("hsa-override", title, "ok", f"Set to {have}, as this GPU needs")
        return Finding("hsa-override", title, "error",
                       f"Set to {have}, but this GPU needs {wanted} (the managed environment sets it for you)",
                       fix=_unset_fix(host), required=True)
    if platform.hsa_override_spoofs:
        gpu = target_gpu(platform, plan)
        real = f" the real {gpu.arch}" if gpu is not None and gpu.arch else " this GPU"
        seen = f" as {gpu.reported_arch}" if gpu is not None and gpu.reported_arch else ""
        return Finding("hsa-override", title, "warning",
                       f"Set to {have}: ROCm reports{real}{seen}, and this GPU needs no override",
                       fix=_unset_fix(host))
    return Finding("hsa-override", title, "ok", f"Set to {have}; it does not change what ROCm reports")


def check_ram(platform: Platform) -> Finding:
    title = "Memory"
    if platform.ram_bytes is None:
        return Finding("ram", title, "skipped", "No probe reported the RAM size")
    if platform.ram_bytes < MIN_RAM_GIB * GIB:
        return Finding("ram", title, "warning",
                       f"{_gib(platform.ram_bytes)} RAM: loading models needs {MIN_RAM_GIB} GiB or more",
                       fix="Close other programs, or train a smaller model (a 0.5B-1B one)")
    return Finding("ram", title, "ok", f"{_gib(platform.ram_bytes)} RAM")


def check_disk(plan: Plan | None, host: HostFacts | None, env_installed: bool) -> Finding:
    title = "Free disk"
    if host is None or host.disk_free_bytes is None:
        return Finding("disk", title, "skipped", NOT_LIVE)
    need = WORK_DISK_GIB if env_installed else ENV_DISK_GIB.get(backend(plan), ENV_DISK_GIB["cpu"])
    what = "for models and checkpoints" if env_installed else f"for the {backend(plan)} environment"
    free = host.disk_free_bytes
    if free < need * GIB:
        return Finding("disk", title, "error", f"{_gib(free)} free in {host.data_dir}; needs about {need} GiB {what}",
                       fix=f"Free some space there, or set UNSLOTH_HOME to a disk with {need} GiB free",
                       required=not env_installed)
    return Finding("disk", title, "ok", f"{_gib(free)} free in {host.data_dir} (needs about {need} GiB {what})")


def check_multi_gpu(platform: Platform, host: HostFacts | None) -> Finding | None:
    """With 2+ GPUs: whether `unsloth train --gpus N` can use them, and how fast they talk to each other."""
    gpus = [g for g in platform.gpus if not g.integrated]
    if len(gpus) < 2:
        return None
    title = "Several GPUs"
    if platform.os == "windows":
        return Finding("multi-gpu", title, "warning",
                       f"{len(gpus)} GPUs, but training on several is not supported on Windows (no NCCL); one is used",
                       fix="For multi-GPU training use Linux, or WSL where its GPUs are visible")
    if host is None:
        return Finding("multi-gpu", title, "skipped", NOT_LIVE)
    text = host.gpu_topology or ""
    topology = parse_nvidia_topo(text) or parse_rocm_topo(text)
    if topology is None or not topology.links:
        return Finding("multi-gpu", title, "ok", f"{len(gpus)} GPUs (`unsloth train --gpus {len(gpus)}`); "
                       "their links are unknown (no nvidia-smi / rocm-smi topology)", detail=text)
    slowest = topology.slowest()
    kinds = sorted({DESCRIPTIONS[kind] for kind in topology.links.values()})
    message = f"{topology.gpus} GPUs linked by {', '.join(kinds)} (`unsloth train --gpus {topology.gpus}`)"
    if slowest == "pcie-sockets":
        return Finding("multi-gpu", title, "warning", message + "; some pairs cross CPU sockets, which slows "
                       "the gradient exchange", fix="Prefer GPUs on one CPU: CUDA_VISIBLE_DEVICES=<those GPUs>",
                       detail=text)
    return Finding("multi-gpu", title, "ok", message, detail=text)
