"""`--with vllm` in the plan: its wheel and the exact torch it pins where the matrix lists one (Linux and
WSL, x86_64 and aarch64, an NVIDIA GPU and driver its CUDA build covers), a refusal with the reason and
what still works everywhere else, and nothing at all when it was not asked for."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import HealthCheck, given, settings

from plan_helpers import amd, machine, nvidia
from test_plan_invariants import platforms
from unsloth.matrix import MatrixError, parse_matrix
from unsloth.plan import Plan, Vllm, resolve
from unsloth.platform.facts import Gpu

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

STILL_WORKS = "unsloth's own fast generation path"


@pytest.fixture(scope="module")
def row(matrix):
    (only,) = matrix.vllm  # the matrix lists one CUDA release; these tests read its pins from there
    return only


def with_vllm(platform, matrix, **kw):
    return resolve(platform, matrix, with_parts=("vllm",), **kw)


@pytest.mark.parametrize("platform", [
    machine("linux", nvidia("sm_89", name="NVIDIA GeForce RTX 4090")),
    machine("wsl", nvidia("sm_120", name="NVIDIA GeForce RTX 5090")),
    machine("linux", nvidia("sm_90", name="NVIDIA GH200"), machine="aarch64"),
    machine("linux", nvidia("sm_121", name="NVIDIA GB10"), machine="arm64"),
], ids=["linux-x86_64", "wsl-x86_64", "linux-aarch64", "dgx-spark-arm64"])
def test_cuda_linux_and_wsl_get_vllm_with_the_torch_its_wheel_pins(platform, matrix, row):
    default = resolve(platform, matrix)
    plan = with_vllm(platform, matrix)
    assert plan.vllm == Vllm("pypi", row.spec, f"torch{row.torch}", row.python, plan.vllm.note)
    # The torch the wheel was built against, from that index, with the rest of the family it pins.
    assert plan.torch.backend == "cuda" and plan.torch.variant == row.variant
    assert plan.torch.version_spec == f"torch{row.torch}"
    assert plan.torch.packages == ["torch", *row.torch_packages]
    assert plan.torch.index_url == f"https://download.pytorch.org/whl/{row.variant}"
    # ... and it says so, naming what it replaced.
    assert f"torch{row.torch}" in plan.vllm.note and default.torch.version_spec in plan.vllm.note
    assert row.source in plan.sources
    # Nothing else about the plan moves.
    same = {k: v for k, v in plan.to_json().items() if k not in ("torch", "vllm", "sources", "llama_cpp")}
    assert same == {k: v for k, v in default.to_json().items() if k not in ("torch", "sources", "llama_cpp")}


@pytest.mark.parametrize("platform, why", [
    (machine("windows", nvidia("sm_89")), "no wheel for native Windows (only for Linux and WSL)"),
    (machine("macos", Gpu("apple", name="Apple M3 Max", integrated=True), machine="arm64"), "no wheel for macOS"),
    (machine("linux", amd("gfx1100", name="AMD Radeon RX 7900 XTX")), "no ROCm (AMD) wheel"),
    (machine("linux", amd("gfx942", name="AMD Instinct MI300X")), "no ROCm (AMD) wheel"),
    (machine("linux"), "need a CUDA GPU, and this machine has none it can train on"),
    (machine("wsl"), "need a CUDA GPU, and this machine has none it can train on"),
    (machine("linux", nvidia("sm_52", name="NVIDIA GeForce GTX 980")), "do not cover compute capability 5.2"),
    (machine("linux", nvidia("sm_89"), nvidia_driver="550.54.14", cuda_driver="12.4"),
     "NVIDIA driver 550.54.14 is older than the 580"),
    (machine("linux", nvidia("sm_90"), machine="ppc64le"), "no wheel for ppc64le CPUs (only aarch64, x86_64)"),
], ids=["windows", "macos", "rocm-rdna3", "rocm-instinct", "cpu-linux", "cpu-wsl", "maxwell", "old-driver", "ppc64le"])
def test_everywhere_else_vllm_is_refused_with_why_and_what_still_works(platform, why, matrix):
    default = resolve(platform, matrix)
    plan = with_vllm(platform, matrix)
    assert plan.vllm.source == "none" and not plan.vllm.available and plan.vllm.spec is None
    assert plan.vllm.note.startswith("--with vllm is refused: ") and why in plan.vllm.note, plan.vllm.note
    assert STILL_WORKS in plan.vllm.note and "\n" not in plan.vllm.note  # one line
    # Refused, not half-applied: the torch and everything else are the default plan's.
    assert {k: v for k, v in plan.to_json().items() if k != "vllm"} == default.to_json()
    assert json.loads(json.dumps(plan.to_json()))["vllm"]["source"] == "none"  # kept in the JSON, never dropped


def test_not_asked_for_vllm_is_absent_from_the_plan_and_its_json(matrix):
    platform = machine("linux", nvidia("sm_89"))
    plan = resolve(platform, matrix)
    assert plan.vllm is None and "vllm" not in plan.to_json()
    assert resolve(platform, matrix, with_parts=()).to_json() == plan.to_json()


def test_a_plan_with_vllm_reads_back_from_its_json(matrix):
    for platform in (machine("linux", nvidia("sm_89")), machine("windows", nvidia("sm_89"))):
        data = json.loads(json.dumps(with_vllm(platform, matrix).to_json()))
        plan = Plan.from_json(data)
        assert isinstance(plan.vllm, Vllm) and plan.to_json() == data


def test_an_unknown_driver_does_not_refuse_and_the_driver_warning_stays(matrix, row):
    platform = machine("linux", nvidia("sm_89"), nvidia_driver=None, cuda_driver=None)
    plan = with_vllm(platform, matrix)
    assert plan.vllm.available and plan.torch.variant == row.variant
    assert any(w.check == "driver" for w in plan.warnings)


def test_a_torch_mirror_of_vllms_index_is_kept_and_another_build_refused(matrix, row):
    platform = machine("linux", nvidia("sm_89"))
    mirror = f"https://mirror.example/whl/{row.variant}"
    plan = with_vllm(platform, matrix, overrides={"torch_index_url": mirror})
    assert plan.vllm.available and plan.torch.index_url == mirror and plan.torch.version_spec == f"torch{row.torch}"
    other = with_vllm(platform, matrix, overrides={"torch_index_url": "https://mirror.example/whl/cu126"})
    assert not other.vllm.available and "UNSLOTH_TORCH_INDEX_URL pins a cu126 PyTorch" in other.vllm.note
    moved = with_vllm(platform, matrix, overrides={"pytorch_mirror": "https://mirror.example/whl"})
    assert moved.torch.index_url == f"https://mirror.example/whl/{row.variant}"


def test_a_driver_that_picks_an_older_cuda_build_moves_to_vllms(matrix, row):
    """A 12.x-reporting 580 driver plans a 12.x build by default; vLLM's cu130 build runs on it, so it moves."""
    platform = machine("linux", nvidia("sm_89"), nvidia_driver="580.65.06", cuda_driver="12.8")
    default = resolve(platform, matrix)
    plan = with_vllm(platform, matrix)
    assert default.torch.variant != row.variant and plan.torch.variant == row.variant
    assert f"in place of {default.torch.version_spec} ({default.torch.variant})" in plan.vllm.note


def test_a_matrix_without_vllm_rows_refuses_it_everywhere(matrix):
    bare = dataclasses.replace(matrix, vllm=())
    plan = resolve(machine("linux", nvidia("sm_89")), bare, with_parts=("vllm",))
    assert not plan.vllm.available and "vLLM publishes no wheel for Linux" in plan.vllm.note


def _matrix_data(matrix) -> dict:
    return tomllib.loads(open(matrix.path, encoding="utf-8").read())


@pytest.mark.parametrize("change, problem", [
    ({"spec": "vllm>=0.32"}, "must pin one vllm release"),
    ({"spec": "notvllm==1.0"}, "must pin one vllm release"),
    ({"variant": "cu999"}, "is not a cuda_index variant"),
    ({"torch": "2.13.0"}, "'torch' '2.13.0' is not a version specifier"),
    ({"torch_packages": ["torchvision=0.28"]}, "is not a requirement"),
    ({"os": ["linux", "bsd"]}, "unknown os 'bsd'"),
    ({"backend": "rocm"}, "bad backend 'rocm'; expected one of cuda"),
    ({"souce": "typo"}, "unknown key 'souce'"),
])
def test_bad_vllm_rows_are_refused_naming_the_row(matrix, change, problem):
    data = _matrix_data(matrix)
    data["vllm"] = [{**data["vllm"][0], **change}]
    with pytest.raises(MatrixError, match=f"^m.toml: vllm '{data['vllm'][0]['spec']}': ") as raised:
        parse_matrix(data, "m.toml")
    assert problem in str(raised.value)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(platform=platforms)
def test_with_vllm_either_pins_its_torch_or_refuses_and_changes_nothing(matrix, platform):
    """Generated machines: an included vLLM always comes with its exact torch on an NVIDIA GPU under
    Linux or WSL; a refused one leaves the plan exactly as without --with, with its reason in one line."""
    default = resolve(platform, matrix)
    plan = with_vllm(platform, matrix)
    if plan.vllm.available:
        row = next(r for r in matrix.vllm if r.spec == plan.vllm.spec)
        assert plan.os in row.oses and plan.device is not None and plan.device.vendor == "nvidia"
        assert (plan.torch.variant, plan.torch.version_spec) == (row.variant, f"torch{row.torch}")
        assert plan.bitsandbytes == default.bitsandbytes and plan.fits == default.fits
    else:
        assert {k: v for k, v in plan.to_json().items() if k != "vllm"} == default.to_json()
        assert plan.vllm.note.startswith("--with vllm is refused: ") and STILL_WORKS in plan.vllm.note
        assert "\n" not in plan.vllm.note
