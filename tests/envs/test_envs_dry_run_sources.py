"""`install --dry-run` names the sources the real install will use on this machine: the user's pip
configuration (files and PIP_* variables, read by pip itself), the flags on top, a wheelhouse holding the
plan's exact torch, and how llama.cpp will be fetched or built."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from unsloth.cli import main

pytestmark = pytest.mark.slow  # each dry run detects this machine and asks pip for its configuration

TAG = f"cp{sys.version_info[0]}{sys.version_info[1]}"


@pytest.fixture
def pip_config(tmp_path, monkeypatch):
    """A pip configuration of our own: the machine's PIP_* variables out, ours in; its files still load
    first, and ours (PIP_CONFIG_FILE, loaded last) overrides each key they set."""
    for name in list(os.environ):
        if name.startswith(("PIP_", "UNSLOTH_")):
            monkeypatch.delenv(name)
    wheelhouse = tmp_path / "wheelhouse"
    wheelhouse.mkdir()
    config = tmp_path / "pip.conf"
    config.write_text("[global]\nindex-url = https://mirror.example/simple\n"
                      "extra-index-url = https://extra.example/simple\n"
                      f"find-links = {wheelhouse}\nconstraint = {tmp_path / 'c.txt'}\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(config))
    monkeypatch.setenv("COLUMNS", "1000")  # the plan table on one line per row: long paths unbroken
    return wheelhouse


def _dry_run(capsys, *flags):
    assert main(["install", "--dry-run", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_pip_configuration_and_its_variables_are_named(pip_config, capsys, monkeypatch):
    sources = _dry_run(capsys)["install_sources"]
    packages = sources["packages"]
    assert packages["index_url"] == "https://mirror.example/simple"
    assert packages["extra_index_urls"] == ["https://extra.example/simple"]
    assert packages["find_links"] == [str(pip_config)] and packages["from"] == "your pip configuration"

    monkeypatch.setenv("PIP_INDEX_URL", "https://env-mirror.example/simple")  # pip: a variable beats the files
    assert _dry_run(capsys)["install_sources"]["packages"]["index_url"] == "https://env-mirror.example/simple"

    flagged = _dry_run(capsys, "--index-url", "https://flag.example/simple")["install_sources"]["packages"]
    assert flagged["index_url"] == "https://flag.example/simple"
    assert flagged["from"] == "your pip configuration + --index-url"

    ignored = _dry_run(capsys, "--ignore-pip-config")["install_sources"]["packages"]
    assert ignored["index_url"] is None and ignored["find_links"] == [] and "ignored" in ignored["from"]


def test_torch_comes_from_a_wheelhouse_with_the_exact_build_else_the_plans_index(pip_config, capsys):
    plan = _dry_run(capsys)
    torch = plan["torch"]
    assert plan["install_sources"]["torch"] == {"mode": "index", "url": torch["index_url"],
                                        "requirements": [torch["version_spec"] or "torch", *torch["packages"][1:]]}
    if torch["packages"] != ["torch"]:
        pytest.skip("a wheelhouse serves torch alone; this machine's plan also asks for " + ", ".join(torch["packages"]))
    local = f"+{torch['variant']}" if torch["variant"] else ""
    (pip_config / f"torch-2.13.0{local}-{TAG}-{TAG}-linux_x86_64.whl").write_bytes(b"")
    (pip_config / f"torch-2.14.0+other-{TAG}-{TAG}-linux_x86_64.whl").write_bytes(b"")  # another build: not it
    assert _dry_run(capsys)["install_sources"]["torch"] == {"mode": "wheelhouse", "url": str(pip_config),
                                                    "requirements": [f"torch==2.13.0{local}"]}
    assert main(["install", "--dry-run"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert f"torch==2.13.0{local} from the wheelhouse {pip_config}" in text
    assert "https://mirror.example/simple, extra index https://extra.example/simple" in text


def test_llama_cpp_is_named_as_the_build_step_will_run_it(pip_config, capsys, tmp_path):
    from unsloth.envs.sources import parse_pip_config
    from unsloth.envs.steps import Request, Tool, llama_cpp_step

    plan = _dry_run(capsys)
    llama = plan["install_sources"]["llama_cpp"]
    assert llama["backend"] == plan["llama_cpp"]["backend"] and llama["cmake_args"] == plan["llama_cpp"]["cmake_args"]
    # The build's own steps, for the same plan and sources: the prebuilt index alone, then a source build
    # from the package sources with the plan's CMAKE_ARGS.
    from unsloth.plan import LlamaCpp

    sources = parse_pip_config(f"global.index-url='{plan['install_sources']['packages']['index_url']}'")
    request = Request(source=str(tmp_path), sources=sources)
    tool = Tool.uv("uv", tmp_path / "python")
    plan_llama = LlamaCpp.from_json(plan["llama_cpp"])
    first = llama_cpp_step(tool, request, tmp_path / "pins", ["llama-cpp-python>=0.3"], plan_llama, cache=tmp_path)
    if llama["prebuilt_index"]:
        assert first.argv[first.argv.index("--index-url") + 1] == llama["prebuilt_index"] and "--no-deps" in first.argv
    fallback = llama_cpp_step(tool, request, tmp_path / "pins", ["llama-cpp-python>=0.3"], plan_llama, cache=tmp_path,
                              prebuilt=False)
    assert fallback.env["CMAKE_ARGS"] == llama["cmake_args"] and "https://mirror.example/simple" in fallback.argv

    assert main(["install", "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "built from source (minutes) from the package sources" in text
    if llama["prebuilt_index"]:
        assert f"prebuilt from {llama['prebuilt_index']}; where that index cannot serve it" in text

    assert _dry_run(capsys, "--without", "export")["install_sources"]["llama_cpp"] is None
    assert main(["install", "--dry-run", "--without", "llama-cpp"]) == 0
    assert "left out (--without)" in capsys.readouterr().out


def test_a_dump_plan_names_no_sources(capsys):
    """This machine's pip configuration says nothing about another machine's sources."""
    dump = Path(__file__).parents[1] / "installers" / "fixtures" / "nvidia-smi__rtx4090_wsl__1"
    plan = _dry_run(capsys, "--from", str(dump))
    assert plan["torch"]["backend"] == "cuda" and "install_sources" not in plan
