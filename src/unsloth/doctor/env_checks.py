"""The environment checks: is the managed environment there and healthy, and does its own Python
import torch, see the GPU the plan expects, multiply on it, round-trip bitsandbytes 4-bit, run a
Triton kernel and load llama.cpp?

`run_env_probe` is the one side effect: it runs env_probe.py in the environment's interpreter
with a timeout. Turning what the probe printed into findings (`probe_findings`) is pure.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from unsloth.doctor import env_probe
from unsloth.doctor.checks import backend, target_gpu
from unsloth.doctor.findings import Finding
from unsloth.envs.receipt import hardware_fingerprint
from unsloth.platform.facts import Platform
from unsloth.plan import Plan

DEFAULT_TIMEOUT_S = 180  # torch + bitsandbytes imports and a first Triton compile; a hang is far longer
REINSTALL = "unsloth install --force"  # a plain install is a no-op while the request is unchanged
TITLES = {
    "torch": "torch",
    "gpu": "torch sees the GPU",
    "matmul": "Matrix multiply",
    "bitsandbytes": "bitsandbytes 4-bit",
    "triton": "Triton kernel",
    "llama_cpp": "llama.cpp",
}


@dataclass
class EnvTarget:
    """The interpreter the environment checks run in, and what is known about it."""

    python: Path
    origin: str  # "managed" (the active environment) | "--python"
    env: Path | None = None
    receipt: dict[str, Any] | None = None


@dataclass
class ProbeRun:
    results: dict[str, dict[str, Any]] = field(default_factory=dict)  # check name -> the probe's line
    timed_out: bool = False
    returncode: int | None = None
    stderr: str = ""
    seconds: float = 0.0
    timeout_s: float = DEFAULT_TIMEOUT_S


def run_env_probe(python: Path, plan_backend: str, timeout_s: float = DEFAULT_TIMEOUT_S,
                  plan_env: Mapping[str, str] | None = None) -> ProbeRun:
    """Run env_probe.py with ``python``, under the plan's env vars (``plan.env``: an
    HSA_OVERRIDE_GFX_VERSION some GPUs need), as training will run. It runs from a fresh folder so
    nothing in the current directory (a project's own `torch/` or `kernels/`) shadows the
    environment's packages."""
    with tempfile.TemporaryDirectory(prefix="unsloth-doctor-") as tmp:
        script = Path(tmp) / "env_probe.py"
        shutil.copyfile(env_probe.__file__, script)
        env = {**os.environ, **(plan_env or {}), "PYTHONNOUSERSITE": "1", "PYTHONDONTWRITEBYTECODE": "1"}
        env.pop("PYTHONPATH", None)  # the environment's own packages, not ours
        start = time.monotonic()
        try:
            # Its own session, so a hang is ended with everything it started (compilers, workers).
            process = subprocess.Popen([str(python), str(script), "--backend", plan_backend], cwd=tmp, env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       start_new_session=os.name == "posix")
        except OSError as exc:  # the interpreter is missing or not executable
            return ProbeRun(stderr=str(exc), timeout_s=timeout_s)
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            _kill(process)
            try:
                stdout, stderr = process.communicate(timeout=10)
            except subprocess.TimeoutExpired:  # a grandchild still holds the pipes (Windows kills only the child)
                stdout, stderr = "", ""
            timed_out = True
        seconds = time.monotonic() - start
    return ProbeRun(parse_probe_output(stdout), timed_out, None if timed_out else process.returncode, stderr,
                    seconds, timeout_s)


def _kill(process: subprocess.Popen) -> None:
    if os.name == "posix":
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    else:
        process.kill()


def parse_probe_output(stdout: str) -> dict[str, dict[str, Any]]:
    results = {}
    for line in stdout.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a package printed to stdout; the checks' lines are whole JSON objects
        if isinstance(record, dict) and "check" in record:
            results[record["check"]] = record
    return results


def check_env(target: EnvTarget | None, platform: Platform | None) -> Finding:
    """The managed environment exists, its receipt reads, its Python is there, and it was built for this machine."""
    title = "Managed environment"
    if target is None:
        return Finding("env", title, "warning", "No managed environment yet", fix="unsloth install")
    if target.origin == "--python":
        if not target.python.is_file():
            return Finding("env", title, "error", f"{target.python} (given with --python) does not exist",
                           fix="Give the path of a Python interpreter, e.g. --python .venv/bin/python", required=True)
        return Finding("env", title, "ok", f"Checking {target.python} (given with --python)")
    if target.receipt is None:
        return Finding("env", title, "error", f"{target.env}: its receipt is missing or unreadable",
                       fix=REINSTALL, required=True)
    if not target.python.exists():
        return Finding("env", title, "error", f"{target.env}: its Python ({target.python}) is missing",
                       fix=REINSTALL, required=True)
    name = target.receipt.get("name") or target.env.name
    built = target.receipt.get("finished", "?")
    if platform is not None and target.receipt.get("fingerprint") not in (None, hardware_fingerprint(platform.to_json())):
        return Finding("env", title, "warning",
                       f"{name} was built for other hardware or drivers than this machine has now",
                       fix=REINSTALL)
    return Finding("env", title, "ok", f"{name} (built {built})", detail=str(target.env))


def finding_id(name: str) -> str:
    return f"env-{name.replace('_', '-')}"  # "llama_cpp" -> "env-llama-cpp"


def skipped_env_findings(reason: str) -> list[Finding]:
    return [Finding(finding_id(name), TITLES[name], "skipped", reason) for name in env_probe.CHECKS]


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
                   without: list[str] | tuple[str, ...] = ()) -> list[Finding]:
    """What the probe printed, judged against the plan. The first check it never reported hung or
    crashed; the ones after it were not reached."""
    context = _Context(platform, plan, tuple(without))
    findings: list[Finding] = []
    stopped = False  # the probe prints in order: after the first missing check, nothing ran
    for name in env_probe.CHECKS:
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
    if context.gpu_plan and result.get("backend") != context.backend:
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
    required = context.plan is not None and context.plan.bitsandbytes.get("source", "none") != "none"
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


def _judge_llama_cpp(result: dict[str, Any], context: _Context) -> Verdict:
    if not result["ok"]:
        left_out = [part for part in ("llama-cpp", "export") if part in context.without]
        if left_out:
            return "skipped", f"Left out at install (--without {left_out[0]})", None, False
        return "warning", f"Does not load: {result['message']}; export and chat need it", REINSTALL, False
    wants_gpu = context.plan is not None and context.plan.llama_cpp.get("backend", "cpu") != "cpu"
    if wants_gpu and not result.get("gpu_offload"):
        return "warning", f"{result['message']}: built without GPU offload, chat will be slow", REINSTALL, False
    return "ok", result["message"], None, False


JUDGES = {
    "torch": _judge_torch,
    "gpu": _judge_gpu,
    "matmul": _judge_matmul,
    "bitsandbytes": _judge_bitsandbytes,
    "triton": _judge_triton,
    "llama_cpp": _judge_llama_cpp,
}
