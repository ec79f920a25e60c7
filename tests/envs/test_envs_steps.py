"""The install as argv lists: each package family only from the source the plan names."""

from pathlib import Path

from unsloth.envs.sources import Sources, TorchSource
from unsloth.envs.steps import (
    Request,
    Tool,
    export_step,
    fla_step,
    llama_cpp_deps_step,
    llama_cpp_step,
    packages_step,
    pins_text,
    torch_step,
)
from unsloth.plan import BitsAndBytes, FlashLinearAttention, LlamaCpp

TOOL = Tool.uv("uv", Path("/e/bin/python"))
GENERAL = Sources(extra_index_urls=("https://mirror/simple",), find_links=("/w",), constraints=("/c.txt",))
PINS = Path("/e/pins.txt")
CACHE = Path("/home/cache")
EXPORT_REQUIRES = ['gguf>=0.17; extra == "export"', 'llama-cpp-python>=0.3.16; extra == "export"']


def flag_values(argv, flag):
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == flag]


def test_torch_from_an_index_sees_no_other_index():
    step = torch_step(TOOL, TorchSource("index", "https://download.pytorch.org/whl/cu128", ("torch>=2.9",)), GENERAL, "cuda")
    assert step.argv[:5] == ["uv", "pip", "install", "--python", "/e/bin/python"]
    assert flag_values(step.argv, "--index-url") == ["https://download.pytorch.org/whl/cu128"]
    assert flag_values(step.argv, "--extra-index-url") == [] and flag_values(step.argv, "--find-links") == []
    assert flag_values(step.argv, "--constraint") == ["/c.txt"]  # the user's constraints still hold
    assert step.argv[-1] == "torch>=2.9"


def test_torch_from_a_wheelhouse_asks_for_the_exact_local_build():
    step = torch_step(TOOL, TorchSource("wheelhouse", "/w", ("torch==2.13.0+cpu",), find_links=("/w",)), GENERAL, "cpu")
    assert flag_values(step.argv, "--find-links") == ["/w"]  # not repeated
    assert step.argv[-1] == "torch==2.13.0+cpu"


def test_pins_keep_the_installed_torch_family_only():
    installed = {"torch": "2.13.0+cpu", "numpy": "2.1", "triton": "3.5.0"}
    assert pins_text(installed, frozenset({"torch", "triton", "torchvision"})) == "torch==2.13.0+cpu\ntriton==3.5.0\n"


def test_packages_step_installs_our_source_never_the_pypi_name():
    request = Request(source="/src/unsloth", sources=GENERAL)
    step = packages_step(TOOL, request, PINS, BitsAndBytes("pypi", "bitsandbytes>=0.46"))
    assert "unsloth-installer[train] @ file:///src/unsloth" in step.argv
    assert "unsloth" not in step.argv and "bitsandbytes>=0.46" in step.argv
    assert flag_values(step.argv, "--constraint") == ["/c.txt", str(PINS)]
    assert flag_values(step.argv, "--reinstall-package") == ["unsloth-installer"]  # a directory: rebuild it
    archive = packages_step(TOOL, Request(source="https://r/unsloth_installer-1.0.tar.gz", without=("train", "bitsandbytes")),
                            PINS, BitsAndBytes("pypi", "bitsandbytes>=0.46"))
    assert archive.argv[-1] == "unsloth-installer @ https://r/unsloth_installer-1.0.tar.gz"
    assert "--reinstall-package" not in archive.argv and "bitsandbytes>=0.46" not in archive.argv


def test_export_tools_leave_llama_cpp_to_its_own_step():
    step = export_step(TOOL, Request(source="/s", sources=GENERAL), PINS, EXPORT_REQUIRES)
    assert step.argv[-1] == "gguf>=0.17" and not any("llama" in arg for arg in step.argv)
    assert export_step(TOOL, Request(source="/s", without=("export",)), PINS, EXPORT_REQUIRES) is None


def test_llama_cpp_prebuilt_comes_from_its_wheel_index_alone_then_its_dependencies():
    plan = LlamaCpp("cuda", "wheel", index_url="https://wheels/cu125", cmake_args="-DGGML_CUDA=on")
    request = Request(source="/s", sources=GENERAL)
    step = llama_cpp_step(TOOL, request, PINS, EXPORT_REQUIRES, plan, cache=CACHE)
    assert flag_values(step.argv, "--index-url") == ["https://wheels/cu125"]
    assert flag_values(step.argv, "--extra-index-url") == [] and flag_values(step.argv, "--find-links") == []
    assert "--no-deps" in step.argv and flag_values(step.argv, "--only-binary") == ["llama-cpp-python"] and step.env == {}
    assert step.argv[-1] == "llama-cpp-python>=0.3.16"
    deps = llama_cpp_deps_step(TOOL, request, PINS, EXPORT_REQUIRES)
    assert flag_values(deps.argv, "--extra-index-url") == ["https://mirror/simple"] and str(PINS) in deps.argv


def test_llama_cpp_source_build_gets_the_plans_cmake_args():
    plan = LlamaCpp("hip", "source", cmake_args="-DGGML_HIP=on -DAMDGPU_TARGETS=gfx1151")
    step = llama_cpp_step(TOOL, Request(source="/s"), PINS, EXPORT_REQUIRES, plan, cache=CACHE)
    assert step.env["CMAKE_ARGS"] == "-DGGML_HIP=on -DAMDGPU_TARGETS=gfx1151"
    assert flag_values(step.argv, "--no-binary") == ["llama-cpp-python"]
    assert "--verbose" in step.argv  # the build's own progress reaches the log and the screen
    assert llama_cpp_step(TOOL, Request(source="/s", without=("llama-cpp",)), PINS, EXPORT_REQUIRES, plan,
                          cache=CACHE) is None


def test_llama_cpp_fallback_builds_from_the_general_sources_when_the_wheel_index_fails():
    plan = LlamaCpp("cpu", "wheel", index_url="https://wheels/cpu")
    step = llama_cpp_step(TOOL, Request(source="/s", sources=GENERAL), PINS, EXPORT_REQUIRES, plan, cache=CACHE,
                          prebuilt=False)
    assert flag_values(step.argv, "--index-url") != ["https://wheels/cpu"] and "--no-deps" not in step.argv
    assert flag_values(step.argv, "--extra-index-url") == ["https://mirror/simple"]
    assert flag_values(step.argv, "--no-binary") == ["llama-cpp-python"] and step.env["CMAKE_ARGS"] == ""


def test_pip_fallback_uses_the_same_flags():
    tool = Tool.pip(Path("/e/bin/python"))
    step = torch_step(tool, TorchSource("index", "https://download.pytorch.org/whl/cpu", ("torch",)), Sources(), "cpu")
    assert step.argv[:4] == ["/e/bin/python", "-m", "pip", "install"]
    assert flag_values(step.argv, "--index-url") == ["https://download.pytorch.org/whl/cpu"]


def test_a_source_build_has_a_build_cache_per_plan():
    """uv and pip key a wheel built from an sdist by the sdist, not CMAKE_ARGS: one cache per plan."""
    def caches(plan):
        step = llama_cpp_step(TOOL, Request(source="/s"), PINS, EXPORT_REQUIRES, plan, cache=CACHE, prebuilt=False)
        return step.env["UV_CACHE_DIR"], step.env["PIP_CACHE_DIR"]

    cpu = caches(LlamaCpp("cpu", "wheel", index_url="https://wheels/cpu"))
    cuda = caches(LlamaCpp("cuda", "source", cmake_args="-DGGML_CUDA=on"))
    hip_a = caches(LlamaCpp("hip", "source", cmake_args="-DGGML_HIP=on -DAMDGPU_TARGETS=gfx1100"))
    hip_b = caches(LlamaCpp("hip", "source", cmake_args="-DGGML_HIP=on -DAMDGPU_TARGETS=gfx1151"))
    assert len({cpu, cuda, hip_a, hip_b}) == 4  # another backend or GPU target: another cache
    assert caches(LlamaCpp("cuda", "source", cmake_args="-DGGML_CUDA=on")) == cuda  # the same plan: the same
    uv, pip = cuda
    assert Path(uv).parent == Path(pip).parent and Path(uv).parent.parent == CACHE / "llama-cpp"
    assert Path(uv).parent.name.startswith("cuda-")
    prebuilt = llama_cpp_step(TOOL, Request(source="/s"), PINS, EXPORT_REQUIRES,
                              LlamaCpp("cpu", "wheel", index_url="https://wheels/cpu"), cache=CACHE)
    assert prebuilt.env == {}  # a prebuilt wheel is not ours to key


def test_fla_comes_from_the_general_sources_with_everything_installed_pinned():
    pins_all = Path("/e/pins-all.txt")
    plan = FlashLinearAttention("pypi", "flash-linear-attention==0.6.0")
    step = fla_step(TOOL, Request(source="/s", sources=GENERAL), pins_all, plan)
    assert step.name == "fla" and step.argv[-1] == "flash-linear-attention==0.6.0"
    assert flag_values(step.argv, "--constraint") == ["/c.txt", str(pins_all)]
    assert flag_values(step.argv, "--extra-index-url") == ["https://mirror/simple"]
    assert "--index-url" not in step.argv  # no index of its own: the user's configured one and PyPI
    assert fla_step(TOOL, Request(source="/s", without=("fla",)), pins_all, plan) is None
    assert fla_step(TOOL, Request(source="/s"), pins_all, FlashLinearAttention("none", note="CPU")) is None
    assert fla_step(TOOL, Request(source="/s"), pins_all, None) is None  # a matrix without its rows

