"""The environment checks: the probe's lines judged against the plan (pure), and the probe run for
real in this very .venv (CPU torch, bitsandbytes, Triton's interpreter) and in broken interpreters."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import stat
import sys
from pathlib import Path

import pytest

from unsloth.doctor.env_checks import EnvTarget, check_env
from unsloth.envs.receipt import Receipt, hardware_fingerprint
from unsloth.plan import BitsAndBytes, FlashLinearAttention
from unsloth.platform.facts import Gpu, Platform
from unsloth.selftest.judge import probe_findings
from unsloth.selftest.parse import parse_probe_output
from unsloth.selftest.run import ProbeRun, run_env_probe
from unsloth.selftest.script import CHECKS

IDS = [f"env-{name.replace('_', '-')}" for name in CHECKS]


def line(check: str, ok, message: str = "", **facts) -> dict:
    return {"check": check, "ok": ok, "message": message, **facts}


def healthy_gpu_run(arch: str = "sm_89", name: str = "NVIDIA GeForce RTX 4090", backend: str = "cuda") -> ProbeRun:
    device = {"index": 0, "name": name, "arch": arch, "capability": "8.9", "vram_bytes": 24 * 2**30}
    return ProbeRun(results={
        "torch": line("torch", True, f"torch 2.13.0 ({backend} build)", backend=backend),
        "gpu": line("gpu", True, f"{name} ({arch}), 1 GPU(s)", count=1, devices=[device]),
        "matmul": line("matmul", True, "256x256 matmul on cuda:0, max relative error 3.0e-07", error=3e-7),
        "bitsandbytes": line("bitsandbytes", True, "bitsandbytes 0.50.2 NF4 round trip on cuda:0"),
        "triton": line("triton", True, "Triton 3.6.0 compiled and ran a kernel (cuda:0)"),
        "fla": line("fla", True, "flash-linear-attention 0.6.0 imports (Triton 3.6.0)", installed=True,
                    version="0.6.0", triton="3.6.0", capability="8.9"),
        "llama_cpp": line("llama_cpp", True, "llama-cpp-python 0.3.36 (GPU offload: yes)", gpu_offload=True),
        "multi_gpu": line("multi_gpu", None, "1 GPU(s): nothing to connect"),
    }, returncode=0)


def by_id(findings) -> dict:
    return {finding.id: finding for finding in findings}


# --- judging the probe's lines (pure) -----------------------------------------------------------

def test_a_healthy_gpu_environment_is_all_ok_and_required(make_plan, rtx4090):
    findings = probe_findings(healthy_gpu_run(), Platform(gpus=[rtx4090]), make_plan("cuda", "cu130", rtx4090))
    assert [f.id for f in findings] == IDS
    assert all(f.status == "ok" for f in findings[:-1]) and findings[-1].status == "skipped"  # one GPU
    assert [f.required for f in findings] == [True, True, True, True, True, False, False, False]


def test_a_cpu_torch_where_the_plan_wants_cuda(make_plan, rtx4090):
    run = healthy_gpu_run()
    run.results["torch"] = line("torch", True, "torch 2.13.0+cpu (cpu build)", backend="cpu")
    finding = by_id(probe_findings(run, Platform(gpus=[rtx4090]), make_plan("cuda", "cu130", rtx4090)))["env-torch"]
    assert finding.fails
    assert finding.message == "torch 2.13.0+cpu (cpu build), but the plan needs a cuda build (cu130)"
    assert finding.fix == "unsloth install --force"  # a plain install keeps an unchanged request


def test_a_cpu_torch_where_the_plan_wants_intels_xpu_build(make_plan):
    arc = Gpu("intel", name="Intel Arc B580", family="Arc", integrated=False)
    run = healthy_gpu_run()
    run.results["torch"] = line("torch", True, "torch 2.11.0+cpu (cpu build)", backend="cpu")
    finding = by_id(probe_findings(run, Platform(gpus=[arc]), make_plan("xpu", "xpu", arc)))["env-torch"]
    assert finding.fails and finding.message.endswith("but the plan needs a xpu build (xpu)")
    run.results["torch"] = line("torch", True, "torch 2.11.0+xpu (xpu build)", backend="xpu")
    assert by_id(probe_findings(run, Platform(gpus=[arc]), make_plan("xpu", "xpu", arc)))["env-torch"].status == "ok"


def test_torch_that_sees_no_gpu_fails_and_one_that_sees_another_arch_warns(make_plan, rx7800):
    plan, platform = make_plan("rocm", "rocm7.2", rx7800), Platform(gpus=[rx7800])
    blind = healthy_gpu_run("gfx1101", "AMD Radeon RX 7800 XT", "rocm")
    blind.results["gpu"] = line("gpu", False, "torch sees no GPU", count=0, devices=[])
    finding = by_id(probe_findings(blind, platform, plan))["env-gpu"]
    assert finding.fails and finding.message == "torch sees no GPU; the plan expects AMD Radeon RX 7800 XT"
    spoofed = healthy_gpu_run("gfx1100", "AMD Radeon RX 7800 XT", "rocm")  # HSA_OVERRIDE_GFX_VERSION=11.0.0
    finding = by_id(probe_findings(spoofed, platform, plan))["env-gpu"]
    assert finding.status == "warning"
    assert finding.message == "torch sees AMD Radeon RX 7800 XT as gfx1100, but the GPU is gfx1101"
    assert "unset HSA_OVERRIDE_GFX_VERSION" in finding.fix


def test_a_hang_names_the_check_that_hung_and_the_rest_were_not_reached(make_plan, rtx4090):
    run = healthy_gpu_run()
    for name in ("matmul", "bitsandbytes", "triton", "fla", "llama_cpp", "multi_gpu"):
        del run.results[name]
    run.timed_out, run.returncode, run.timeout_s, run.stderr = True, None, 60, "stuck in cuLaunchKernel"
    found = by_id(probe_findings(run, Platform(gpus=[rtx4090]), make_plan("cuda", "cu130", rtx4090)))
    hung = found["env-matmul"]
    assert hung.fails and hung.message == "Hung: no answer within 60 s"
    assert "dmesg" in hung.fix and "--timeout 180" in hung.fix and hung.detail == "stuck in cuLaunchKernel"
    assert [found[i].status for i in IDS[3:]] == ["skipped"] * 5
    assert found["env-torch"].status == "ok"
    run.timeout_s = 0.5  # a short --timeout is named as given, not rounded to "0 s"
    hung = by_id(probe_findings(run, Platform(gpus=[rtx4090]), make_plan("cuda", "cu130", rtx4090)))["env-matmul"]
    assert hung.message == "Hung: no answer within 0.5 s" and "--timeout 1.5" in hung.fix


def test_a_crash_reports_the_exit_code(make_plan):
    run = ProbeRun(results={"torch": line("torch", True, "torch", backend="cpu")}, returncode=-11, stderr="Segfault")
    found = by_id(probe_findings(run, Platform(), make_plan()))
    assert found["env-gpu"].fails and "exited with code -11" in found["env-gpu"].message


def test_optional_parts(make_plan, rtx4090):
    run = healthy_gpu_run()
    run.results["bitsandbytes"] = line("bitsandbytes", False, "ModuleNotFoundError: No module named 'bitsandbytes'")
    run.results["llama_cpp"] = line("llama_cpp", False, "ModuleNotFoundError: No module named 'llama_cpp'")
    no_bnb = make_plan("cuda", "cu130", rtx4090, bitsandbytes=BitsAndBytes("none"))
    found = by_id(probe_findings(run, Platform(gpus=[rtx4090]), no_bnb, without=("llama-cpp",)))
    assert found["env-bitsandbytes"].status == "skipped"
    assert found["env-llama-cpp"].message == "Left out at install (--without llama-cpp)"
    found = by_id(probe_findings(run, Platform(gpus=[rtx4090]), make_plan("cuda", "cu130", rtx4090)))
    assert found["env-bitsandbytes"].fails
    assert found["env-llama-cpp"].status == "warning" and not found["env-llama-cpp"].required
    cpu_llama = healthy_gpu_run()
    cpu_llama.results["llama_cpp"] = line("llama_cpp", True, "llama-cpp-python 0.3.36 (GPU offload: no)",
                                          gpu_offload=False)
    found = by_id(probe_findings(cpu_llama, Platform(gpus=[rtx4090]), make_plan("cuda", "cu130", rtx4090)))
    assert found["env-llama-cpp"].status == "warning" and "without GPU offload" in found["env-llama-cpp"].message


HOPPER = Gpu("nvidia", name="NVIDIA H200", arch="sm_90", family="Hopper", compute_capability="9.0")
ON_HOPPER = FlashLinearAttention("pypi", "flash-linear-attention==0.6.0", triton="3.7.1", broken_triton=">=3.4.0,<3.7.1")
LEFT_OUT = FlashLinearAttention("none", note="left out: on NVIDIA H200 its gated backward is wrong with Triton "
                                ">=3.4.0,<3.7.1, and torch>=2.9,<2.12 pins Triton 3.6.0; ...",
                                triton="3.6.0", broken_triton=">=3.4.0,<3.7.1")
NOT_INSTALLED = line("fla", False, "flash-linear-attention is not installed", installed=False)


def _fla_line(triton: str) -> dict:
    return line("fla", True, f"flash-linear-attention 0.6.0 imports (Triton {triton})", installed=True,
                version="0.6.0", triton=triton, capability="9.0")


@pytest.mark.parametrize("part, result, without, status, words", [
    (ON_HOPPER, _fla_line("3.7.1"), (), "ok", ("0.6.0 imports (Triton 3.7.1)", "use its kernels")),
    # A Triton the plan did not expect (an older environment, a mirror's older torch): installed, but unused.
    (ON_HOPPER, _fla_line("3.6.0"), (), "warning", ("but not used", "Triton >=3.4.0,<3.7.1", "torch path")),
    (ON_HOPPER, _fla_line("3.7.1+git"), (), "ok", ("use its kernels",)),
    (ON_HOPPER, NOT_INSTALLED, (), "warning", ("not installed", "transformers' slower torch path")),
    (ON_HOPPER, NOT_INSTALLED, ("fla",), "skipped", ("Left out at install (--without fla)",)),
    (LEFT_OUT, NOT_INSTALLED, (), "skipped", ("Not in the plan here: left out: on NVIDIA H200",)),
    (None, NOT_INSTALLED, (), "skipped", ("no flash-linear-attention rows",)),
    (ON_HOPPER, line("fla", None, "torch did not import"), (), "skipped", ("torch did not import",)),
])
def test_fla_is_checked_against_the_plans_hopper_triton_rule(make_plan, part, result, without, status, words):
    run = healthy_gpu_run("sm_90", "NVIDIA H200")
    run.results["fla"] = result
    plan = make_plan("cuda", "cu130", HOPPER, flash_linear_attention=part)
    plan.torch.version_spec = "torch>=2.9,<2.14"
    finding = by_id(probe_findings(run, Platform(gpus=[HOPPER]), plan, without=without))["env-fla"]
    assert (finding.status, finding.required, finding.title) == (status, False, "fla kernels")
    assert all(word in finding.message for word in words), finding.message
    if "but not used" in finding.message:
        assert "unsloth update" in finding.fix and "torch>=2.9,<2.14" in finding.fix
    if status == "warning" and "not installed" in finding.message:
        assert finding.fix == "unsloth install --force"


def _two_gpu_line(nccl=True, copy_ok=True, peers=(True, True), collective="NCCL"):
    peer_access = {"0-1": peers[0], "1-0": peers[1]}
    message = f"2 GPUs, {collective} {'available' if nccl else 'missing'}, ..."
    return line("multi_gpu", nccl and copy_ok, message, count=2, collective=collective, nccl=nccl,
                peer_access=peer_access, copy_ok=copy_ok)


@pytest.mark.parametrize("case, os, expected_status, words", [
    (dict(), "linux", "ok", ("NCCL available",)),
    (dict(nccl=False), "linux", "warning", ("cannot run without NCCL", )),
    (dict(nccl=False, collective="RCCL"), "linux", "warning", ("cannot run without RCCL",)),
    (dict(copy_ok=False), "linux", "warning", ("peer-to-peer between the GPUs is broken",)),
    (dict(peers=(False, False)), "linux", "warning", ("through host memory",)),
    (dict(nccl=False), "windows", "skipped", ("not supported on Windows",)),
])
def test_two_gpus_in_torch(make_plan, rtx4090, case, os, expected_status, words):
    run = healthy_gpu_run()
    run.results["multi_gpu"] = _two_gpu_line(**case)
    found = by_id(probe_findings(run, Platform(os=os, gpus=[rtx4090, rtx4090]), make_plan("cuda", "cu130", rtx4090)))
    finding = found["env-multi-gpu"]
    assert finding.status == expected_status and not finding.required
    assert all(word in finding.message for word in words), finding.message
    if case.get("copy_ok") is False:
        assert "NCCL_P2P_DISABLE=1" in finding.fix


def test_probe_output_survives_stray_prints():
    stdout = "hello from a package\n" + json.dumps(line("torch", True, "torch 2")) + "\n{not json\n[1, 2]\n"
    assert list(parse_probe_output(stdout)) == ["torch"]


# --- the environment itself -----------------------------------------------------------------------

def test_environment_presence_and_health(tmp_path):
    assert check_env(None, None).status == "warning" and check_env(None, None).fix == "unsloth install"
    env = tmp_path / "envs" / "e1"
    python = env / "bin" / "python"
    broken = check_env(EnvTarget(python, "managed", env, Receipt("e1")), None)
    assert broken.fails and "its Python" in broken.message
    python.parent.mkdir(parents=True)
    python.write_text("")
    assert check_env(EnvTarget(python, "managed", env, None), None).fails  # unreadable receipt
    platform = Platform(os="linux")
    built_here = Receipt("e1", finished="2026-11-29T10:00:00+00:00", fingerprint=hardware_fingerprint(platform.to_json()))
    assert check_env(EnvTarget(python, "managed", env, built_here), platform).status == "ok"
    moved = check_env(EnvTarget(python, "managed", env, built_here), Platform(os="linux", nvidia_driver="580.1"))
    assert moved.status == "warning" and "other hardware" in moved.message
    missing = check_env(EnvTarget(tmp_path / "nope", "--python"), None)
    assert missing.fails and "--python" in missing.message


# --- the probe for real -----------------------------------------------------------------------------

@pytest.mark.slow
def test_the_probe_in_this_venv_sees_cpu_torch_and_runs_everything_on_the_cpu(make_plan):
    """This very interpreter: CPU torch, no GPU, bitsandbytes and Triton (interpreter) on the CPU."""
    run = run_env_probe(Path(sys.executable), "cpu", timeout_s=240)
    assert (run.timed_out, run.returncode) == (False, 0), run.stderr
    results = run.results
    assert results["python"]["executable"] == sys.executable
    assert results["torch"]["ok"] and results["torch"]["version"] == importlib.metadata.version("torch")
    assert results["torch"]["backend"] == "cpu"
    assert results["gpu"]["ok"] is False and results["gpu"]["count"] == 0
    assert results["matmul"]["ok"] and results["matmul"]["device"] == "cpu" and results["matmul"]["error"] < 1e-5
    assert results["bitsandbytes"]["ok"] and 0.01 < results["bitsandbytes"]["error"] < 0.2
    assert results["triton"]["ok"] and results["triton"]["mode"] == "interpreter"
    assert results["llama_cpp"]["ok"] is (importlib.util.find_spec("llama_cpp") is not None)
    if importlib.util.find_spec("fla") is None:
        assert results["fla"]["ok"] is False and results["fla"]["installed"] is False
    assert results["multi_gpu"]["ok"] is None and "0 GPU(s)" in results["multi_gpu"]["message"]

    found = by_id(probe_findings(run, Platform(os="linux"), make_plan()))
    assert found["env-gpu"].status == "skipped"  # the plan is CPU: no GPU to look for
    assert [found[i].status for i in ("env-torch", "env-matmul", "env-bitsandbytes", "env-triton")] == ["ok"] * 4


def _fake_python(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "python"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


@pytest.mark.skipif(os.name != "posix", reason="the fake interpreter is a shell script")
def test_a_hanging_interpreter_is_stopped_at_the_timeout_with_what_it_said(tmp_path, make_plan):
    first = json.dumps(line("torch", True, "torch 2 (cpu build)", backend="cpu"))
    # The child keeps the output pipe open: only killing the whole session ends the wait.
    python = _fake_python(tmp_path, f"echo '{first}'\nsleep 30 &\nsleep 30")
    run = run_env_probe(python, "cpu", timeout_s=1)
    assert run.timed_out and run.seconds < 10
    found = by_id(probe_findings(run, Platform(), make_plan()))
    assert found["env-torch"].status == "ok"
    assert found["env-gpu"].fails and found["env-gpu"].message.startswith("Hung")


def test_a_missing_interpreter_is_a_finding_not_a_traceback(tmp_path, make_plan):
    run = run_env_probe(tmp_path / "no-python", "cpu", timeout_s=5)
    found = by_id(probe_findings(run, Platform(), make_plan()))
    assert found["env-torch"].fails and "did not start" in found["env-torch"].message
    assert "No such file" in found["env-torch"].detail


@pytest.mark.skipif(os.name != "posix", reason="the fake interpreter is a shell script")
def test_the_probe_runs_under_the_plans_env_vars_from_a_clean_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    monkeypatch.setenv("HSA_OVERRIDE_GFX_VERSION", "10.3.0")  # a stale hand-set value: the plan's wins
    python = _fake_python(tmp_path, 'printf \'{"check": "torch", "ok": true, "message": "%s|%s|%s"}\\n\' '
                                    '"$HSA_OVERRIDE_GFX_VERSION" "${PYTHONPATH:-unset}" "$(ls)"')
    run = run_env_probe(python, "rocm", timeout_s=10, plan_env={"HSA_OVERRIDE_GFX_VERSION": "11.0.0"})
    assert run.results["torch"]["message"] == "11.0.0|unset|selftest.py"


GPU_BACKEND = "rocm" if os.path.exists("/dev/kfd") else "cuda" if shutil.which("nvidia-smi") else None


@pytest.mark.slow
@pytest.mark.skipif(GPU_BACKEND is None, reason="needs an NVIDIA or AMD GPU (run on the GPU machine)")
def test_the_probe_on_a_real_gpu():
    """This interpreter on a GPU machine: the matmul and the Triton kernel run on the GPU itself."""
    run = run_env_probe(Path(sys.executable), GPU_BACKEND, timeout_s=300)
    assert not run.timed_out, run.stderr
    results = run.results
    assert results["torch"]["ok"] and results["torch"]["backend"] == GPU_BACKEND
    assert results["gpu"]["ok"] and results["gpu"]["count"] >= 1
    device = results["gpu"]["devices"][0]
    assert device["arch"].startswith("gfx" if GPU_BACKEND == "rocm" else "sm_") and device["vram_bytes"] > 2**30
    assert results["matmul"]["ok"] and results["matmul"]["device"] == "cuda:0"
    assert results["triton"]["ok"] and results["triton"]["mode"] == "cuda:0", results["triton"]
    if importlib.util.find_spec("bitsandbytes") is not None:
        assert results["bitsandbytes"]["ok"], results["bitsandbytes"]
    if importlib.util.find_spec("fla") is not None:
        assert results["fla"]["ok"] and results["fla"]["triton"], results["fla"]
        assert (results["fla"]["capability"] == device["capability"]) is (GPU_BACKEND == "cuda")
    if results["gpu"]["count"] >= 2:
        assert results["multi_gpu"]["ok"] and results["multi_gpu"]["copy_ok"], results["multi_gpu"]
    else:
        assert results["multi_gpu"]["ok"] is None


def test_triton_missing_on_a_cpu_plan_is_no_fault(make_plan):
    """A CPU environment has no Triton on purpose (our kernels need a GPU): skipped, not a warning."""
    run = healthy_gpu_run()
    run.results["triton"] = line("triton", False, "ModuleNotFoundError: No module named 'triton'")
    finding = by_id(probe_findings(run, Platform(), make_plan("cpu", "cpu", None)))["env-triton"]
    assert finding.status == "skipped" and not finding.fails and finding.fix is None
