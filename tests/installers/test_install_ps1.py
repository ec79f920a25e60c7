"""install.ps1 cannot run here (no PowerShell): it must parse, keep its shape, and the Python side it
hands over to must plan and lay out a Windows install correctly (Windows dumps through --from)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tree_sitter
import tree_sitter_powershell

from unsloth.envs import launcher, paths
from unsloth.envs.sources import Sources, TorchSource
from unsloth.envs.steps import Request, Tool, llama_cpp_step, torch_step
from unsloth.plan import LlamaCpp

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "install.ps1"
WINDOWS_DUMP = Path(__file__).parent / "fixtures" / "Get-WmiObject__gfx1036+gfx1100_windows__1"
# Cmdlets that ship with Windows PowerShell 5.1 and PowerShell 7; anything else must be defined in the script.
BUILTIN = {"Copy-Item", "Expand-Archive", "Get-Command", "Get-Content", "Get-FileHash", "Invoke-WebRequest", "Join-Path",
           "New-Item", "Out-Null", "Read-Host", "Remove-Item", "Select-String", "Split-Path", "Start-Sleep", "Test-Path", "Write-Host"}


@pytest.fixture(scope="module")
def tree():
    parser = tree_sitter.Parser(tree_sitter.Language(tree_sitter_powershell.language()))
    return parser.parse(SCRIPT.read_bytes())


def nodes(node, kind):
    if node.type == kind:
        yield node
    for child in node.children:
        yield from nodes(child, kind)


def text(node) -> str:
    return node.text.decode()


def test_parses_without_errors(tree):
    broken = [n for n in nodes(tree.root_node, "ERROR")] + [n for n in _missing(tree.root_node)]
    assert not tree.root_node.has_error, [(n.start_point, text(n)[:80]) for n in broken]


def _missing(node):
    if node.is_missing:
        yield node
    for child in node.children:
        yield from _missing(child)


def test_a_cut_download_runs_nothing_but_the_last_line(tree):
    """Top level: settings and function definitions only; the one call that does anything is last."""
    statements = [c for c in tree.root_node.children if c.type == "statement_list"][0].children
    statements = [s for s in statements if s.type != "comment"]
    assert text(statements[-1]) == "Install-Unsloth @args"
    for statement in statements[:-1]:
        assert statement.type == "function_statement" or re.fullmatch(r"\$\w+ = [^;\n]+", text(statement)), text(statement)


def test_every_command_it_calls_exists(tree):
    defined = {text(n) for n in nodes(tree.root_node, "function_name")}
    called = {text(n) for n in nodes(tree.root_node, "command_name") if "-" in text(n)}
    assert called - defined - BUILTIN == set()
    assert defined - called == set()  # no dead functions


def test_both_installers_take_the_same_documented_variables():
    names = lambda path: set(re.findall(r"UNSLOTH_[A-Z0-9_]+", path.read_text()))  # noqa: E731
    ps1, sh = names(SCRIPT), names(REPO / "install.sh")
    documented = names(REPO / "docs" / "install.md")
    assert ps1 - documented == set() and sh - documented == set()
    shared = {"UNSLOTH_HOME", "UNSLOTH_SOURCE", "UNSLOTH_VERSION", "UNSLOTH_PYTHON", "UNSLOTH_INDEX_URL",
              "UNSLOTH_TORCH_INDEX_URL", "UNSLOTH_FIND_LINKS", "UNSLOTH_WITHOUT", "UNSLOTH_NO_MODIFY_PATH", "UNSLOTH_UV"}
    assert shared <= ps1 and shared <= sh


def test_both_installers_take_the_same_options():
    """One interface: every install.sh flag is an install.ps1 parameter (--index-url is -IndexUrl)."""
    usage = (REPO / "install.sh").read_text().split("usage() {")[1].split("EOF")[1]
    sh = {"".join(part.capitalize() for part in flag.split("-")) for flag in re.findall(r"--([a-z][a-z-]*)", usage)}
    function = SCRIPT.read_text().split("function Install-Unsloth {")[1].split("    )")[0]
    declared = re.findall(r"(?:\[Alias\('(\w+)'\)\] )?\[(?:switch|string)\]\$(\w+)", function)
    ps1 = {alias or name for alias, name in declared} - {"PassThrough"}
    assert sh == ps1
    usage_ps1 = SCRIPT.read_text().split("function Show-Usage {")[1].split("'@")[0]
    assert {name for name in ps1 if f"-{name}" not in usage_ps1} == set()  # and its help lists them all


def test_the_windows_plan_from_a_dump():
    done = subprocess.run([sys.executable, "-m", "unsloth.cli", "install", "--dry-run", "--json", "--from", str(WINDOWS_DUMP)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    expected = json.loads((WINDOWS_DUMP / "expect.json").read_text())["plan"]
    assert plan["os"] == "windows" and plan["support"] == expected["support"]
    assert plan["torch"]["backend"] == expected["torch_backend"]
    # What `unsloth install` would run on that machine: torch only from the plan's index ...
    python = Path("C:/Users/u/AppData/Local/unsloth/envs/e/Scripts/python.exe")
    tool = Tool.uv("uv.exe", python)
    torch = TorchSource("index", plan["torch"]["index_url"], (plan["torch"]["version_spec"],))
    step = torch_step(tool, torch, Sources(extra_index_urls=("https://mirror/simple",)), plan["torch"]["backend"])
    assert step.argv.count("--index-url") == 1 and "--extra-index-url" not in step.argv
    assert step.argv[step.argv.index("--index-url") + 1] == plan["torch"]["index_url"]
    # ... and llama-cpp-python from its wheel index alone, with no source build.
    llama = llama_cpp_step(tool, Request(source="C:/src"), Path("pins.txt"), ["llama-cpp-python>=0.3"],
                           LlamaCpp.from_json(plan["llama_cpp"]), cache=Path("C:/Users/u/AppData/Local/unsloth/cache"))
    if plan["llama_cpp"]["how"] == "wheel":
        assert llama.argv[llama.argv.index("--index-url") + 1] == plan["llama_cpp"]["index_url"]
        assert "--only-binary" in llama.argv and "--extra-index-url" not in llama.argv
    else:
        assert llama.env["CMAKE_ARGS"] == plan["llama_cpp"]["cmake_args"]


def test_windows_layout(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setenv("UNSLOTH_HOME", str(tmp_path))
    monkeypatch.delenv("UNSLOTH_BIN_DIR", raising=False)
    env = tmp_path / "envs" / "e"
    assert paths.env_python(env) == env / "Scripts" / "python.exe"
    assert paths.bin_dir() == tmp_path / "bin"
    assert launcher.launcher_path(paths.bin_dir()).name == "unsloth.cmd"
    cmd = launcher.launcher_text(Path("C:/Users/u/AppData/Local/unsloth"), windows=True)
    lines = cmd.split("\r\n")
    assert lines[0] == "@echo off" and "setlocal" in lines  # the env name does not leak into the user's shell
    assert 'set /p UNSLOTH_ENV=<"C:/Users/u/AppData/Local/unsloth\\current"' in lines
    assert '"C:/Users/u/AppData/Local/unsloth\\envs\\%UNSLOTH_ENV%\\Scripts\\unsloth.exe" %*' in lines
    assert "exit /b %ERRORLEVEL%" in lines and launcher.MARKER[2:] in cmd
    missing = 'if not exist "C:/Users/u/AppData/Local/unsloth\\current"'  # nothing installed: say so, exit 1
    assert f"{missing} exit /b 1" in lines and lines.index(f"{missing} exit /b 1") < lines.index(
        'set /p UNSLOTH_ENV=<"C:/Users/u/AppData/Local/unsloth\\current"')
