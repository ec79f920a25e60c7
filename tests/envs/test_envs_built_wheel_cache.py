"""A llama-cpp-python source build is reused for the same plan and never for another one, through the
real uv: a stand-in sdist named llama-cpp-python whose build records the CMAKE_ARGS it was built with."""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from rich.console import Console

from unsloth.envs.build import find_uv, step_env
from unsloth.envs.paths import CACHE, env_python
from unsloth.envs.runner import run_step
from unsloth.envs.sources import Sources
from unsloth.envs.steps import Request, Tool, llama_cpp_step
from unsloth.plan import LlamaCpp

pytestmark = pytest.mark.slow

# A PEP 517 backend in the sdist itself (requires nothing, so uv builds offline): each build appends its
# CMAKE_ARGS to $FAKE_BUILD_LOG and bakes them into the wheel.
BACKEND = '''
import base64, hashlib, os, zipfile

NAME, VERSION = "llama_cpp_python", "0.0.1"
INFO = f"{NAME}-{VERSION}.dist-info"


def get_requires_for_build_wheel(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    cmake_args = os.environ.get("CMAKE_ARGS", "")
    with open(os.environ["FAKE_BUILD_LOG"], "a") as log:
        log.write(cmake_args + "\\n")
    files = {
        "llama_cpp_fake.py": f"CMAKE_ARGS = {cmake_args!r}\\n",
        f"{INFO}/METADATA": f"Metadata-Version: 2.1\\nName: llama-cpp-python\\nVersion: {VERSION}\\n",
        f"{INFO}/WHEEL": "Wheel-Version: 1.0\\nGenerator: fake\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{INFO}/RECORD"] = "\\n".join(record + [f"{INFO}/RECORD,,"]) + "\\n"
    name = f"{NAME}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)
    return name
'''

PYPROJECT = '''[build-system]
requires = []
build-backend = "backend"
backend-path = ["."]

[project]
name = "llama-cpp-python"
version = "0.0.1"
'''


def _sdist(folder: Path) -> Path:
    folder.mkdir()
    path = folder / "llama_cpp_python-0.0.1.tar.gz"
    files = {"pyproject.toml": PYPROJECT, "backend.py": BACKEND,
             "PKG-INFO": "Metadata-Version: 2.1\nName: llama-cpp-python\nVersion: 0.0.1\n"}
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"llama_cpp_python-0.0.1/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_a_source_build_is_reused_for_its_plan_only(tmp_path, monkeypatch):
    uv = find_uv()
    if uv is None:
        pytest.skip("uv is not installed")
    sources = Sources(no_index=True, find_links=(str(_sdist(tmp_path / "sdists").parent),))
    request = Request(source=str(tmp_path), sources=sources)
    root, pins, log = tmp_path / "home", tmp_path / "pins.txt", tmp_path / "builds.txt"
    pins.write_text("")
    monkeypatch.setenv("FAKE_BUILD_LOG", str(log))
    for name in ("UV_CACHE_DIR", "PIP_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)

    def install(plan: LlamaCpp, n: int) -> str:
        env = tmp_path / f"env{n}"
        subprocess.run([uv, "venv", "--quiet", "--python", sys.executable, str(env)], check=True, capture_output=True)
        python = env_python(env)
        step = llama_cpp_step(Tool.uv(uv, python), request, pins, ["llama-cpp-python==0.0.1"], plan,
                              cache=root / CACHE, prebuilt=False)
        step.env = step_env(root, request, step)  # as the build runs it
        run_step(step, tmp_path / "logs", Console(file=io.StringIO()), n)
        done = subprocess.run([str(python), "-c", "import llama_cpp_fake; print(llama_cpp_fake.CMAKE_ARGS)"],
                              capture_output=True, text=True, check=True)
        return done.stdout.strip()

    def builds() -> list[str]:
        return log.read_text().splitlines() if log.exists() else []

    cuda = LlamaCpp("cuda", "source", cmake_args="-DGGML_CUDA=on")
    vulkan = LlamaCpp("vulkan", "source", cmake_args="-DGGML_VULKAN=on")
    assert install(cuda, 1) == "-DGGML_CUDA=on" and builds() == ["-DGGML_CUDA=on"]
    assert install(vulkan, 2) == "-DGGML_VULKAN=on"  # one cache for both would install the CUDA build here
    assert builds() == ["-DGGML_CUDA=on", "-DGGML_VULKAN=on"]
    assert install(cuda, 3) == "-DGGML_CUDA=on"
    assert builds() == ["-DGGML_CUDA=on", "-DGGML_VULKAN=on"]  # the same plan again: no rebuild
