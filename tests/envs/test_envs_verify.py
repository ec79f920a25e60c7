"""A built environment is switched to only if its torch build and imports fit the plan."""

import sys
from pathlib import Path

import pytest

from unsloth.envs.build import BuildFailed, _json_from
from unsloth.envs.verify import problems, torch_backend

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
