"""`--with vllm` in the build: the plan's exact torch family from the torch index alone, vLLM in the same
resolution as transformers and TRL, a Python its wheels do not install on stopped before any download,
and a request without it hashing as it always did."""

from pathlib import Path

import pytest

from unsloth.envs import build
from unsloth.envs.sources import Sources, TorchSource, torch_source
from unsloth.envs.steps import Request, Tool, packages_step, torch_step
from unsloth.matrix import default_path, load_matrix
from unsloth.plan import BitsAndBytes, resolve
from unsloth.platform.facts import Gpu, Platform

TOOL = Tool.uv("uv", Path("/e/bin/python"))
PINS = Path("/e/pins.txt")
GENERAL = Sources(extra_index_urls=("https://mirror/simple",))


def rtx4090(os: str) -> Platform:
    driver = ("580.65.06", "13.0") if os == "linux" else ("581.57", "13.0")
    return Platform(os=os, machine="x86_64", nvidia_driver=driver[0], cuda_driver=driver[1],
                    gpus=[Gpu("nvidia", name="NVIDIA GeForce RTX 4090", arch="sm_89", vram_bytes=24 * 2**30)])


@pytest.fixture(scope="module")
def plans():
    matrix = load_matrix(default_path())
    return resolve(rtx4090("linux"), matrix), resolve(rtx4090("linux"), matrix, with_parts=("vllm",))


def test_the_torch_step_asks_the_torch_index_for_the_whole_pinned_family(plans):
    _, plan = plans
    source = torch_source(plan.torch, GENERAL, "cp312", {})
    assert source == TorchSource("index", plan.torch.index_url, (plan.torch.version_spec, *plan.torch.packages[1:]))
    assert any(req.startswith("torchvision==") for req in source.requirements)  # never from PyPI
    step = torch_step(TOOL, source, GENERAL, "cuda")
    assert step.argv[step.argv.index("--index-url") + 1] == plan.torch.index_url
    assert "--extra-index-url" not in step.argv and step.argv[-len(source.requirements):] == list(source.requirements)


def test_a_wheelhouse_torch_alone_cannot_serve_the_pinned_family(plans, tmp_path):
    _, plan = plans
    listing = {str(tmp_path): ["torch-2.13.0+cu130-cp312-cp312-manylinux_2_28_x86_64.whl"]}
    source = torch_source(plan.torch, Sources(find_links=(str(tmp_path),)), "cp312", listing)
    assert source.mode == "index"  # torchvision / torchaudio are not in it: the index serves all three


def test_vllm_joins_the_packages_step_only_when_the_plan_has_it(plans):
    default, plan = plans
    request = Request(source="/src/unsloth", sources=GENERAL, with_parts=("vllm",))
    step = packages_step(TOOL, request, PINS, BitsAndBytes("pypi", "bitsandbytes>=0.46"), plan.vllm)
    assert plan.vllm.spec in step.argv and "bitsandbytes>=0.46" in step.argv
    assert step.argv[step.argv.index("--constraint") + 1] == str(PINS)  # the torch family stays as installed
    without = packages_step(TOOL, Request(source="/src/unsloth"), PINS, BitsAndBytes("none"), default.vllm)
    assert not any(arg.startswith("vllm") for arg in without.argv)
    refused = resolve(rtx4090("windows"), load_matrix(default_path()), with_parts=("vllm",)).vllm
    assert not any(arg.startswith("vllm") for arg in packages_step(TOOL, request, PINS, BitsAndBytes("none"),
                                                                   refused).argv)


def test_a_request_without_with_hashes_as_before_and_one_with_it_differs(plans):
    default, plan = plans
    plain = Request(source="/s")
    assert "with" not in plain.to_json()  # environments built before --with existed stay up to date
    assert Request(source="/s", with_parts=("vllm",)).to_json()["with"] == ["vllm"]
    hashes = {build.request_hash(request, p.to_json(), "id", "fp")
              for request, p in ((plain, default), (Request(source="/s", with_parts=("vllm",)), plan))}
    assert len(hashes) == 2


def test_a_python_vllm_does_not_install_on_stops_the_build_with_the_fix(plans):
    default, plan = plans
    with pytest.raises(build.BuildFailed) as raised:
        build._check_python_for_vllm(plan, "3.10.14", "/usr/bin/python3.10")
    assert plan.vllm.python in str(raised.value) and "3.10.14" in str(raised.value)
    assert "--python python3.12" in raised.value.fix
    build._check_python_for_vllm(plan, "3.12.3", "python3.12")  # its Pythons pass
    build._check_python_for_vllm(default, "3.10.14", "python3.10")  # no vLLM: any Python the rest takes
