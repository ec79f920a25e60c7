"""pip configuration -> sources, and where PyTorch may come from."""

import os

from unsloth.envs.sources import Sources, TorchSource, parse_pip_config, torch_source, wheelhouse_torch, with_overrides
from unsloth.plan import TorchChoice

# Verbatim shape of `pip config list` (values are Python reprs; ":env:" are PIP_* variables).
PIP_CONFIG = """\
global.cert='/etc/ssl/certs/ca-certificates.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/opt/wheels'
global.index-url='https://mirror.example/simple'
install.index-url='https://install-section.example/simple'
:env:.find-links='/srv/wheelhouse'
:env:.default-timeout='180'
global.some-other-key='ignored'
"""


def test_pip_config_follows_pips_precedence():
    sources = parse_pip_config(PIP_CONFIG)
    assert sources.index_url == "https://install-section.example/simple"  # [install] beats [global]
    assert sources.find_links == ("/srv/wheelhouse",)  # PIP_FIND_LINKS beats the files
    assert sources.extra_index_urls == ("file:///opt/pypi/simple", "file:///opt/pypi-more/simple")
    assert sources.constraints == ("/etc/xdg/pip/constraints.txt",)
    assert sources.cert == "/etc/ssl/certs/ca-certificates.crt"
    assert sources.timeout == "180"
    inherited = {"PIP_FIND_LINKS": "/opt/wheels", "UV_INDEX_URL": "https://elsewhere", "UV_CACHE_DIR": "/c", "HOME": "/h"}
    env = sources.env(inherited)
    assert env["PIP_FIND_LINKS"] is None and env["UV_INDEX_URL"] is None  # already folded into the flags
    assert "UV_CACHE_DIR" not in env and "HOME" not in env
    assert env["PIP_CONFIG_FILE"] == os.devnull and env["UV_NO_CONFIG"] == "1"
    assert env["SSL_CERT_FILE"] == env["PIP_CERT"] == "/etc/ssl/certs/ca-certificates.crt"
    assert env["UV_HTTP_TIMEOUT"] == env["PIP_DEFAULT_TIMEOUT"] == "180"


def test_empty_or_garbled_pip_config_means_pypi():
    assert parse_pip_config("") == Sources()
    assert parse_pip_config("not a config line\n=\nglobal.=x") == Sources()


def test_sources_become_flags_uv_and_pip_share():
    sources = Sources(index_url="https://m/simple", extra_index_urls=("https://x/simple",), find_links=("/w",),
                      constraints=("/c.txt",), no_index=True)
    assert sources.args() == ["--no-index", "--index-url", "https://m/simple", "--extra-index-url", "https://x/simple",
                              "--find-links", "/w", "--constraint", "/c.txt"]


def test_overrides_add_to_the_pip_configuration():
    base = parse_pip_config(PIP_CONFIG)
    merged = with_overrides(base, index_url="https://corp/simple", find_links=["/more"])
    assert merged.index_url == "https://corp/simple"
    assert merged.find_links == ("/srv/wheelhouse", "/more")
    assert merged.extra_index_urls == base.extra_index_urls


LISTING = {
    "/w": [
        "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl",
        "torch-2.12.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl",
        "torch-2.14.0+cpu-cp312-cp312-manylinux_2_28_x86_64.whl",  # another Python
        "torch-2.13.0+cu128-cp311-cp311-manylinux_2_28_x86_64.whl",
        "torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl",  # no local tag: not the cpu build
        "not-a-wheel.txt",
        "numpy-2.0.0-cp311-cp311-manylinux_2_28_x86_64.whl",
    ]
}


def test_wheelhouse_torch_picks_the_newest_build_of_the_variant_for_this_python():
    assert wheelhouse_torch(("/w",), "cpu", "cp311", LISTING) == ("/w", "torch==2.13.0+cpu")
    assert wheelhouse_torch(("/w",), "cpu", "cp312", LISTING) == ("/w", "torch==2.14.0+cpu")
    assert wheelhouse_torch(("/w",), "cu128", "cp311", LISTING) == ("/w", "torch==2.13.0+cu128")
    assert wheelhouse_torch(("/w",), "rocm6.4", "cp311", LISTING) is None
    assert wheelhouse_torch(("/w",), "cpu", "cp311", LISTING, "torch<2.13") == ("/w", "torch==2.12.0+cpu")


def test_torch_source_override_beats_wheelhouse_beats_plan_index():
    choice = TorchChoice(backend="cpu", variant="cpu", index_url="https://download.pytorch.org/whl/cpu")
    sources = Sources(find_links=("/w",))
    assert torch_source(choice, sources, "cp311", LISTING) == TorchSource(
        "wheelhouse", "/w", ("torch==2.13.0+cpu",), find_links=("/w",))
    assert torch_source(choice, sources, "cp311", LISTING, override_url="https://mirror/cpu") == TorchSource(
        "index", "https://mirror/cpu", ("torch",))
    assert torch_source(choice, Sources(), "cp311", LISTING) == TorchSource(
        "index", "https://download.pytorch.org/whl/cpu", ("torch",))


def test_torch_source_keeps_the_plan_spec_and_companions_on_the_plan_index():
    choice = TorchChoice(backend="cuda", variant="cu128", index_url="https://download.pytorch.org/whl/cu128",
                         version_spec="torch>=2.9,<2.14", packages=["torch", "torchvision"])
    # torchvision is not in the wheelhouse: the whole family comes from the plan's index.
    assert torch_source(choice, Sources(find_links=("/w",)), "cp311", LISTING) == TorchSource(
        "index", "https://download.pytorch.org/whl/cu128", ("torch>=2.9,<2.14", "torchvision"))
