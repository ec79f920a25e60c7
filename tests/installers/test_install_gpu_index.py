"""A GPU plan (from a dump) built for real against small local indexes this test makes:
each package must come from the index the plan names, even when another index offers a
"better" version under the same name (dependency confusion)."""

from __future__ import annotations

import base64
import hashlib
import subprocess
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
from installers_sandbox import copy_source, sandbox_env
from rich.console import Console

from unsloth.envs.build import BuildFailed, build
from unsloth.envs.paths import active_env, env_python
from unsloth.envs.receipt import read_receipt
from unsloth.envs.sources import Sources
from unsloth.envs.steps import Request
from unsloth.matrix import load_matrix
from unsloth.plan import resolve
from unsloth.platform.detect import detect_from_dump

pytestmark = [pytest.mark.slow, pytest.mark.network]  # our own small dependencies still come from PyPI

NVIDIA_DUMP = Path(__file__).parent / "fixtures" / "nvidia-smi__rtx4090_wsl__1"

FAKE_TORCH = '''
__version__ = "{version}"
ORIGIN = "{origin}"
class version:
    cuda = {cuda!r}
    hip = None
class cuda:
    @staticmethod
    def is_available():
        return {cuda!r} is not None
    @staticmethod
    def get_device_name(index=0):
        return "Stand-in GPU"
class backends:
    class mps:
        @staticmethod
        def is_available():
            return False
'''


def make_wheel(folder: Path, name: str, version: str, module: str, source: str) -> None:
    """A minimal, valid pure-Python wheel holding one module."""
    dist = f"{name.replace('-', '_')}-{version}"
    files = {
        f"{module}/__init__.py": source,
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    record.append(f"{dist}.dist-info/RECORD,,")
    files[f"{dist}.dist-info/RECORD"] = "\n".join(record) + "\n"
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)


def make_index(root: Path, packages: list[tuple[str, str, str, str]]) -> str:
    """A PEP 503 simple index on disk; returns its file:// URL."""
    files = root / "files"
    for name, version, module, source in packages:
        make_wheel(files, name, version, module, source)
    for wheel in sorted(files.iterdir()):
        project = wheel.name.split("-")[0].replace("_", "-").lower()
        page = root / "simple" / project / "index.html"
        page.parent.mkdir(parents=True, exist_ok=True)
        links = page.read_text() if page.exists() else ""
        page.write_text(links + f'<a href="../../files/{wheel.name}">{wheel.name}</a>\n')
    return (root / "simple").as_uri()


def torch_wheel(version: str, origin: str, cuda: str | None):
    return ("torch", version, "torch", FAKE_TORCH.format(version=version, origin=origin, cuda=cuda))


def marker(name: str, origin: str):
    return f'ORIGIN = "{origin}"\n'


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-index")
    torch_index = make_index(root / "torch-index", [torch_wheel("2.9.0+cu126", "torch-index", "12.6")])
    # The general mirror offers the same names, and higher versions: none of it may be taken.
    mirror = make_index(root / "mirror", [
        torch_wheel("2.9.0+cu126", "mirror", "12.6"),
        torch_wheel("99.0", "mirror", "12.6"),
        ("bitsandbytes", "0.99.0", "bitsandbytes", marker("bitsandbytes", "mirror")),
        ("llama-cpp-python", "9.9.9", "llama_cpp", marker("llama_cpp", "mirror")),
        ("flash-linear-attention", "0.6.0", "fla", marker("fla", "mirror")),
    ])
    llama_index = make_index(root / "llama-index", [("llama-cpp-python", "0.3.99", "llama_cpp", marker("llama_cpp", "llama-index"))])
    cpu_only = make_index(root / "cpu-only", [torch_wheel("2.9.0+cpu", "cpu-only", None)])
    platform, _ = detect_from_dump(NVIDIA_DUMP)
    env = sandbox_env(root, tmp_path_factory.getbasetemp())
    return {"root": root, "source": copy_source(root / "src"), "platform": platform, "torch_index": torch_index,
            "mirror": mirror, "llama_index": llama_index, "cpu_only": cpu_only, "env": env}


def gpu_plan(world, torch_index: str):
    plan = resolve(world["platform"], load_matrix(), overrides={"torch_index_url": torch_index})
    plan.llama_cpp = replace(plan.llama_cpp, how="wheel", index_url=world["llama_index"])  # "pointed at" the local one
    return plan


def run_build(world, plan, home: Path, monkeypatch, use_pip: bool = False):
    for key in ("UV_CACHE_DIR", "PIP_CACHE_DIR"):
        monkeypatch.setenv(key, world["env"][key])
    monkeypatch.setenv("UNSLOTH_HOME", str(home))
    request = Request(source=str(world["source"]), sources=Sources(extra_index_urls=(world["mirror"],)), without=("train",))
    console = Console(file=open(home.parent / f"{home.name}.screen", "w"), width=200)
    return build(home, request, plan, world["platform"], console, use_pip=use_pip, doctor_checks=False)


def origin_in(env: Path, module: str) -> str:
    code = f"import {module}; print({module}.ORIGIN)"
    return subprocess.run([str(env_python(env)), "-c", code], capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.parametrize("tool", ["uv", "pip"])
def test_each_package_comes_from_the_index_the_plan_names(world, tmp_path, monkeypatch, tool):
    plan = gpu_plan(world, world["torch_index"])
    assert plan.torch.backend == "cuda" and plan.torch.index_url == world["torch_index"]
    assert plan.bitsandbytes.source == "pypi"  # the plan takes bitsandbytes from the general index
    env = run_build(world, plan, tmp_path / "home", monkeypatch, use_pip=tool == "pip")
    assert read_receipt(env).installer["tool"] == tool
    assert origin_in(env, "torch") == "torch-index"
    assert origin_in(env, "bitsandbytes") == "mirror"
    assert origin_in(env, "llama_cpp") == "llama-index"
    assert plan.flash_linear_attention.spec == "flash-linear-attention==0.6.0"
    assert origin_in(env, "fla") == "mirror"  # from the general sources, with the plan's other packages
    receipt = read_receipt(env)
    assert receipt.packages["flash-linear-attention"] == "0.6.0" and receipt.optional_failed == {}
    assert receipt.packages["torch"] == "2.9.0+cu126"
    assert receipt.packages["llama-cpp-python"] == "0.3.99"
    assert receipt.indexes["torch"] == {"mode": "index", "url": world["torch_index"], "requirements": [plan.torch.version_spec]}
    assert receipt.verified["gpu_seen"] is True and receipt.verified["cuda"] == "12.6"
    torch_log = (env / "logs" / "02-torch.log").read_text().splitlines()[0]
    assert world["torch_index"] in torch_log and world["mirror"] not in torch_log


def test_a_failed_fla_install_leaves_it_out_and_the_environment_is_built(world, tmp_path, monkeypatch):
    """flash-linear-attention is an accelerator (our torch chunked rule runs those layers without it):
    where it cannot install, the build goes on, and the receipt says so for doctor."""
    plan = gpu_plan(world, world["torch_index"])
    plan.flash_linear_attention = replace(plan.flash_linear_attention, spec="flash-linear-attention==9.9.9")
    env = run_build(world, plan, tmp_path / "home", monkeypatch)
    receipt = read_receipt(env)
    assert set(receipt.optional_failed) == {"fla"} and "flash-linear-attention" not in receipt.packages
    assert Path(receipt.optional_failed["fla"]).name.endswith("fla.log")
    assert Path(receipt.optional_failed["fla"]).is_file()  # its log stays with the environment
    shown = (tmp_path / "home.screen").read_text()
    assert "flash-linear-attention (Qwen3.5's linear-attention kernels) failed[/]" not in shown
    assert "flash-linear-attention (Qwen3.5's linear-attention kernels) failed; continuing without it" in shown


def test_a_cpu_torch_on_a_gpu_plan_is_refused_and_nothing_is_left(world, tmp_path, monkeypatch):
    home = tmp_path / "home"
    plan = gpu_plan(world, world["cpu_only"])
    with pytest.raises(BuildFailed) as failed:
        run_build(world, plan, home, monkeypatch)
    assert failed.value.found == ["torch 2.9.0+cpu is a cpu build, but the plan needs cuda"]
    assert world["cpu_only"] in failed.value.fix and "--torch-index-url" in failed.value.fix
    assert list((home / "envs").iterdir()) == [] and active_env(home) is None
    kept = sorted(p.name for p in failed.value.log.iterdir())  # the failed build's logs survive it
    assert "02-torch.log" in kept and failed.value.log.parent == home / "logs"
