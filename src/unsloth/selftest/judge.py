"""What the self-test printed, judged against the plan: one finding per check. Pure."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from unsloth.platform.facts import Gpu, Platform
from unsloth.plan import Plan
from unsloth.selftest.findings import Finding
from unsloth.selftest.run import ProbeRun
from unsloth.selftest.script import checks_with

REINSTALL = "unsloth install --force"  # a plain install is a no-op while the request is unchanged
TITLES = {
    "torch": "torch",
    "gpu": "torch sees the GPU",
    "matmul": "Matrix multiply",
    "bitsandbytes": "bitsandbytes 4-bit",
    "triton": "Triton kernel",
    "fla": "fla kernels",  # flash-linear-attention
    "llama_cpp": "llama.cpp",
    "multi_gpu": "Several GPUs in torch",
    "vllm": "vLLM",
}


def target_gpu(platform: Platform, plan: Plan | None) -> Gpu | None:
    """The GPU the checks are about: the plan's device, else the first discrete GPU, else any."""
    if plan is not None and plan.device is not None:
        return plan.device
    discrete = [g for g in platform.gpus if not g.integrated]
    return (discrete or platform.gpus or [None])[0]


def backend(plan: Plan | None) -> str:
    return plan.torch.backend if plan is not None else "cpu"


def finding_id(name: str) -> str:
    return f"env-{name.replace('_', '-')}"  # "llama_cpp" -> "env-llama-cpp"


def opt_in_checks(plan_json: Mapping[str, Any] | None) -> tuple[str, ...]:
    """The opt-in parts a plan (as JSON: a receipt's, or ``plan.to_json()``) installed, whose checks run
    too: vLLM where `--with vllm` put it in. Nothing for a plan without it, so doctor says nothing of it."""
    vllm = (plan_json or {}).get("vllm") or {}
    return ("vllm",) if vllm.get("source", "none") != "none" else ()


def skipped_env_findings(reason: str, with_checks: tuple[str, ...] = ()) -> list[Finding]:
    return [Finding(finding_id(name), TITLES[name], "skipped", reason) for name in checks_with(with_checks)]


@dataclass(frozen=True)
class _Context:
    platform: Platform
    plan: Plan | None
    without: tuple[str, ...]  # optional parts the environment was installed without

    @property
    def backend(self) -> str:
        return backend(self.plan)

    @property
    def gpu_plan(self) -> bool:
        return self.backend in ("cuda", "rocm")


# What a judge returns: (status, message, fix, required).
Verdict = tuple[str, str, str | None, bool]


def probe_findings(run: ProbeRun, platform: Platform, plan: Plan | None,
                   without: list[str] | tuple[str, ...] = (), with_checks: tuple[str, ...] = ()) -> list[Finding]:
    """What the probe printed, judged against the plan. The first check it never reported hung or
    crashed; the ones after it were not reached. ``with_checks``: the opt-in parts it was run with."""
    context = _Context(platform, plan, tuple(without))
    findings: list[Finding] = []
    stopped = False  # the probe prints in order: after the first missing check, nothing ran
    for name in checks_with(with_checks):
        result = run.results.get(name)
        if result is not None:
            status, message, fix, required = JUDGES[name](result, context)
            findings.append(Finding(finding_id(name), TITLES[name], status, message, fix, required, _detail(result)))
        elif stopped:
            findings.append(Finding(finding_id(name), TITLES[name], "skipped", "Not reached"))
        else:
            findings.append(_missing(name, run))
            stopped = True
    return findings


def _detail(result: dict[str, Any]) -> str:
    facts = {k: v for k, v in result.items() if k not in ("check", "ok", "message", "traceback")}
    return json.dumps(facts, sort_keys=True) + (f"\n{result['traceback']}" if result.get("traceback") else "")


def _missing(name: str, run: ProbeRun) -> Finding:
    tail = "\n".join(run.stderr.strip().splitlines()[-15:])
    if run.timed_out:
        return Finding(finding_id(name), TITLES[name], "error", f"Hung: no answer within {run.timeout_s:g} s",
                       fix="Look for GPU driver errors (`sudo dmesg | tail -50`); if the machine is only slow, "
                       f"run `unsloth doctor --timeout {run.timeout_s * 3:g}`", required=True, detail=tail)
    how = f"exited with code {run.returncode}" if run.returncode is not None else "did not start"
    return Finding(finding_id(name), TITLES[name], "error", f"The environment's Python {how} during this check",
                   fix=f"See the error with `unsloth doctor --verbose`; then repair with `{REINSTALL}`",
                   required=True, detail=tail)


def _could_not_run(result: dict[str, Any]) -> Verdict | None:
    return ("skipped", result["message"], None, False) if result["ok"] is None else None


def _judge_torch(result: dict[str, Any], context: _Context) -> Verdict:
    if not result["ok"]:
        return "error", f"torch does not import: {result['message']}", REINSTALL, True
    # An Intel Arc (xpu) plan needs the XPU build too, though the GPU checks below only know CUDA/ROCm.
    if (context.gpu_plan or context.backend == "xpu") and result.get("backend") != context.backend:
        return ("error", f"{result['message']}, but the plan needs a {context.backend} build "
                f"({context.plan.torch.variant})", REINSTALL, True)
    return "ok", result["message"], None, True


def _judge_gpu(result: dict[str, Any], context: _Context) -> Verdict:
    if (skipped := _could_not_run(result)) is not None:
        return skipped
    if not context.gpu_plan:
        return "skipped", f"No GPU in the plan: torch runs on the {context.backend.upper()}", None, False
    expected = target_gpu(context.platform, context.plan)
    if not result["ok"]:
        return ("error", f"torch sees no GPU; the plan expects {expected.name if expected else 'one'}",
                "Fix the GPU findings above (driver, device access, HSA override), then run `unsloth doctor` again",
                True)
    seen = result["devices"][0]
    if expected is not None and expected.arch and seen.get("arch") and seen["arch"] != expected.arch:
        return ("warning", f"torch sees {seen['name']} as {seen['arch']}, but the GPU is {expected.arch}",
                "unset HSA_OVERRIDE_GFX_VERSION, and check CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES", False)
    return "ok", result["message"], None, True


def _judge_matmul(result: dict[str, Any], context: _Context) -> Verdict:
    if (skipped := _could_not_run(result)) is not None:
        return skipped
    if not result["ok"]:
        return "error", f"Wrong or failed: {result['message']}", "Update the GPU driver, then reinstall: unsloth install --force", True
    return "ok", result["message"], None, True


def _judge_bitsandbytes(result: dict[str, Any], context: _Context) -> Verdict:
    required = context.plan is not None and context.plan.bitsandbytes.available
    if (skipped := _could_not_run(result)) is not None:
        return skipped
    if not result["ok"]:
        if not required:
            return "skipped", f"Not in the plan here ({result['message']}); QLoRA is off", None, False
        return "error", f"Failed: {result['message']}", REINSTALL, True
    return "ok", result["message"], None, required


def _judge_triton(result: dict[str, Any], context: _Context) -> Verdict:
    required = context.backend in ("cuda", "rocm", "xpu")  # the training kernels are Triton
    if (skipped := _could_not_run(result)) is not None:
        return skipped
    if not result["ok"]:
        if required:
            return "error", f"Failed: {result['message']}", REINSTALL, True
        # Our kernels need a GPU; on a CPU plan training uses plain PyTorch, so this is no fault.
        return "skipped", f"Not needed here ({result['message']}): without a GPU training uses plain PyTorch", None, False
    return "ok", result["message"], None, required


def _judge_fla(result: dict[str, Any], context: _Context) -> Verdict:
    """An accelerator for Qwen3.5's Gated DeltaNet layers, never required: our torch chunked rule runs
    them without it. Whether it is used here follows the plan's part (the matrix's Hopper/Triton rule)."""
    fla = context.plan.flash_linear_attention if context.plan is not None else None
    wanted = fla is not None and fla.available
    torch_path = "Qwen3.5's Gated DeltaNet layers run on transformers' slower torch path"
    if (skipped := _could_not_run(result)) is not None:
        return skipped
    if not result["ok"]:
        if "fla" in context.without:
            return "skipped", "Left out at install (--without fla)", None, False
        if not wanted:
            why = fla.note if fla is not None else "the hardware matrix has no flash-linear-attention rows"
            return "skipped", f"Not in the plan here: {why}", None, False
        return "warning", f"{result['message']}: {torch_path}", REINSTALL, False
    broken, triton = fla.broken_triton if fla is not None else None, result.get("triton")
    if broken and triton and _in(triton, broken):
        return ("warning", f"{result['message']}, but not used: on this GPU its gated backward is wrong with Triton "
                f"{broken} (fla refuses it), so {torch_path}",
                f"A torch whose Triton is not {broken}: `unsloth update` installs the newest the plan allows "
                f"({context.plan.torch.version_spec or 'torch'})", False)
    return "ok", f"{result['message']}: Qwen3.5's Gated DeltaNet layers use its kernels", None, False


def _in(version: str, specifier: str) -> bool:
    try:
        return SpecifierSet(specifier).contains(Version(version.split("+")[0]), prereleases=True)
    except InvalidVersion:
        return False


def _judge_llama_cpp(result: dict[str, Any], context: _Context) -> Verdict:
    if not result["ok"]:
        left_out = [part for part in ("llama-cpp", "export") if part in context.without]
        if left_out:
            return "skipped", f"Left out at install (--without {left_out[0]})", None, False
        return "warning", f"Does not load: {result['message']}; export and chat need it", REINSTALL, False
    wants_gpu = context.plan is not None and context.plan.llama_cpp.backend != "cpu"
    if wants_gpu and not result.get("gpu_offload"):
        return "warning", f"{result['message']}: built without GPU offload, chat will be slow", REINSTALL, False
    return "ok", result["message"], None, False


def _judge_vllm(result: dict[str, Any], context: _Context) -> Verdict:
    """Asked only where the install put vLLM in (`--with vllm`): then a failure is an error, but not a
    required one, since GRPO falls back to our own generation path."""
    if (skipped := _could_not_run(result)) is not None:
        return skipped
    if not result["ok"]:
        return "error", f"{result['message']}; GRPO falls back to unsloth's own generation", REINSTALL, False
    return "ok", result["message"], None, False


def _judge_multi_gpu(result: dict[str, Any], context: _Context) -> Verdict:
    if (skipped := _could_not_run(result)) is not None:
        return skipped
    collective = result.get("collective", "NCCL")
    if context.platform.os == "windows":
        return "skipped", f"{result['count']} GPUs, but several-GPU training is not supported on Windows", None, False
    if not result.get("nccl", True):
        return ("warning", f"{result['message']}: `unsloth train --gpus N` cannot run without {collective}",
                REINSTALL, False)
    if not result.get("copy_ok", True):
        return ("warning", f"{result['message']}: peer-to-peer between the GPUs is broken",
                "Run several-GPU jobs with NCCL_P2P_DISABLE=1, and check IOMMU / PCIe ACS settings in the BIOS",
                False)
    if not result["ok"]:
        return "warning", result["message"], REINSTALL, False
    if any(not ok for ok in result.get("peer_access", {}).values()):
        return ("warning", f"{result['message']}: those GPUs talk through host memory, so gradient sync is slower",
                "Nothing to fix for correctness; for speed, GPUs on one PCIe switch or NVLink", False)
    return "ok", result["message"], None, False


JUDGES = {
    "torch": _judge_torch,
    "gpu": _judge_gpu,
    "matmul": _judge_matmul,
    "bitsandbytes": _judge_bitsandbytes,
    "triton": _judge_triton,
    "fla": _judge_fla,
    "llama_cpp": _judge_llama_cpp,
    "multi_gpu": _judge_multi_gpu,
    "vllm": _judge_vllm,
}
