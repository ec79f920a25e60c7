"""A built environment is switched to only if its torch build and imports fit the plan."""

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

from unsloth.envs.build import BuildFailed, _json_from
from unsloth.envs.verify import problems
from unsloth.selftest.parse import parse_probe_output, verification
from unsloth.selftest.run import copy_script
from unsloth.selftest.script import torch_backend

CPU_TORCH = {"version": "2.13.0+cpu", "cuda": None, "hip": None, "gpu_seen": False}
CUDA_TORCH = {"version": "2.9.0+cu128", "cuda": "12.8", "hip": None, "gpu_seen": True}
ROCM_TORCH = {"version": "2.9.0+rocm6.4", "cuda": None, "hip": "6.4.1", "gpu_seen": True}


def probe(torch, **imports):
    return {"torch": torch, "imports": {"transformers": "ok", **imports}}


def test_the_build_is_read_from_torch_itself():
    assert [torch_backend(t) for t in (CPU_TORCH, CUDA_TORCH, ROCM_TORCH)] == ["cpu", "cuda", "rocm"]
    assert torch_backend({"version": "2.8.0+xpu"}) == "xpu"


def test_matching_builds_pass():
    assert problems("cpu", probe(CPU_TORCH), ["transformers"]) == []
    assert problems("cuda", probe(CUDA_TORCH), ["transformers"]) == []
    assert problems("rocm", probe(ROCM_TORCH), []) == []
    assert problems("mps", probe({**CPU_TORCH, "version": "2.13.0", "gpu_seen": True}), []) == []


def test_cpu_torch_on_a_gpu_plan_is_an_error():
    found = problems("cuda", probe(CPU_TORCH), [])
    assert found == ["torch 2.13.0+cpu is a cpu build, but the plan needs cuda"]
    assert problems("rocm", probe(CUDA_TORCH), []) == ["torch 2.9.0+cu128 is a cuda build, but the plan needs rocm"]


def test_a_gpu_build_that_sees_no_gpu_is_an_error():
    assert problems("cuda", probe({**CUDA_TORCH, "gpu_seen": False}), []) == [
        "torch 2.9.0+cu128 is a cuda build but sees no GPU"]


def test_failed_imports_are_named():
    found = problems("cpu", probe({"error": "ImportError: libfoo.so"}, peft="ImportError: boom"), ["transformers", "peft", "trl"])
    assert found == ["torch does not import: ImportError: libfoo.so", "peft does not import: ImportError: boom",
                     "trl does not import: not checked"]


def test_an_interpreter_that_fails_is_a_build_failure_not_a_traceback(tmp_path):
    assert _json_from(Path(sys.executable), "print('[1, 2]')") == [1, 2]
    with pytest.raises(BuildFailed) as failed:
        _json_from(Path(sys.executable), "raise SystemExit('no json module here')")
    assert "no json module here" in failed.value.found[0] and "--python" in failed.value.fix
    with pytest.raises(BuildFailed):
        _json_from(tmp_path / "missing-python", "print(1)")
    with pytest.raises(BuildFailed):
        _json_from(Path(sys.executable), "print('not json')")


def test_the_verification_is_read_from_the_self_tests_lines():
    torch_line = {"check": "torch", "ok": True, "message": "torch 2.9.0 (cuda build)", "seconds": 1.2,
                  "backend": "cuda", **CUDA_TORCH, "device_name": "NVIDIA H200"}
    results = {"torch": torch_line, "imports": {"check": "imports", "modules": {"peft": "ok"}},
               "packages": {"check": "packages", "versions": {"torch": "2.9.0+cu128"}}}
    # the receipt's "verified" keys, exactly (docs/environment.md)
    assert verification(results) == {"torch": {**CUDA_TORCH, "device_name": "NVIDIA H200"},
                                     "imports": {"peft": "ok"}, "packages": {"torch": "2.9.0+cu128"}}
    broken = verification({"torch": {"check": "torch", "ok": False, "message": "ImportError: libfoo.so"}})
    assert broken == {"torch": {"error": "ImportError: libfoo.so"}, "imports": {}, "packages": {}}
    assert problems("cpu", broken, []) == ["torch does not import: ImportError: libfoo.so"]


@pytest.mark.slow
def test_the_self_test_verifies_this_venv(tmp_path):
    """The install's verification run, for real in this interpreter: CPU torch, one missing module."""
    out = subprocess.run([sys.executable, str(copy_script(tmp_path)), "--only", "torch", "--imports", "json", "no_such_module"],
                         capture_output=True, text=True, timeout=240, cwd=tmp_path)
    results = parse_probe_output(out.stdout)
    assert list(results) == ["python", "torch", "imports", "packages"], out.stderr
    probe = verification(results)
    assert probe["torch"]["version"] == importlib.metadata.version("torch") and probe["torch"]["gpu_seen"] is False
    assert probe["packages"]["torch"] == importlib.metadata.version("torch")
    assert problems("cpu", probe, ["json"]) == []
    assert problems("cpu", probe, ["no_such_module"]) == [
        "no_such_module does not import: ModuleNotFoundError: No module named 'no_such_module'"]
