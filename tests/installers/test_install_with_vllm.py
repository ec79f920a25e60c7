"""`--with vllm` through both installers: install.sh's flag and install.ps1's -With parameter become
UNSLOTH_WITH, which the Python side (`unsloth install`, what install.ps1 hands over to) reads like the
flag; the plan then holds vLLM or refuses it, and a refused one stops the install before anything is written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tree_sitter
import tree_sitter_powershell

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "install.sh"
FIXTURES = Path(__file__).parent / "fixtures"
WINDOWS_DUMP = FIXTURES / "Get-WmiObject__gfx1036+gfx1100_windows__1"
LINUX_CUDA_DUMP = REPO / "tests" / "fixtures" / "dumps" / "nvidia-smi__csv_name_compute_cap__l40s"  # driver 580+
SHELLS = [shell for shell in ("dash", "bash") if shutil.which(shell)]


def unsloth(*args: str, home: Path, **env: str) -> subprocess.CompletedProcess:
    inherited = {k: v for k, v in os.environ.items() if k != "UNSLOTH_WITH"}  # only what the test says
    environ = {**inherited, "UNSLOTH_HOME": str(home / "unsloth"), "HOME": str(home), "COLUMNS": "200",
               "NO_COLOR": "1", **env}
    return subprocess.run([sys.executable, "-m", "unsloth.cli", *args], capture_output=True, text=True, env=environ)


@pytest.mark.parametrize("shell", SHELLS)
def test_install_sh_turns_with_into_unsloth_with(shell, tmp_path):
    """parse_args, as main runs it: every --with adds to UNSLOTH_WITH, exported for `unsloth install`."""
    functions = tmp_path / "functions.sh"
    functions.write_text(SCRIPT.read_text().rsplit('main "$@"', 1)[0])
    probe = f'. {functions}; parse_args --with vllm --yes --with other; sh -c \'printf "%s" "$UNSLOTH_WITH"\''
    done = subprocess.run([shell, "-c", probe], capture_output=True, text=True,
                          env={"PATH": os.environ["PATH"], "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["vllm", "other"]
    missing = subprocess.run([shell, str(SCRIPT), "--with"], capture_output=True, text=True,
                             env={"PATH": os.environ["PATH"], "HOME": str(tmp_path)})
    assert missing.returncode == 1 and "--with needs a value" in missing.stderr
    usage = subprocess.run([shell, str(SCRIPT), "--help"], capture_output=True, text=True,
                           env={"PATH": os.environ["PATH"], "HOME": str(tmp_path)})
    assert "--with PART" in usage.stdout and "UNSLOTH_WITH" in usage.stdout


def test_install_ps1_turns_with_into_unsloth_with():
    parser = tree_sitter.Parser(tree_sitter.Language(tree_sitter_powershell.language()))
    tree = parser.parse((REPO / "install.ps1").read_bytes())
    assert not tree.root_node.has_error
    text = (REPO / "install.ps1").read_text()
    body = text.split("function Install-Unsloth {")[1]
    assert "[string]$With," in body.split("    )")[0]
    assert "if ($With) { $env:UNSLOTH_WITH = $With }" in body


@pytest.mark.parametrize("how", ["flag", "variable"])
def test_the_windows_plan_refuses_vllm_in_one_line(how, tmp_path):
    """install.ps1's Python side: a Windows machine (from its dump) is refused, naming why and what still works."""
    args = ["install", "--dry-run", "--json", "--from", str(WINDOWS_DUMP)]
    done = (unsloth(*args, "--with", "vllm", home=tmp_path) if how == "flag"
            else unsloth(*args, home=tmp_path, UNSLOTH_WITH="vllm"))
    assert done.returncode == 0, done.stderr
    vllm = json.loads(done.stdout)["vllm"]
    assert vllm["source"] == "none" and "no wheel for native Windows" in vllm["note"]
    assert "fast generation path" in vllm["note"]
    text = unsloth("install", "--dry-run", "--from", str(WINDOWS_DUMP), home=tmp_path, UNSLOTH_WITH="vllm")
    (row,) = [line for line in text.stdout.splitlines() if line.startswith("vllm ")]
    assert row.split(None, 1)[1].rstrip() == vllm["note"]
    assert list(tmp_path.iterdir()) == []


def test_a_linux_cuda_plan_takes_vllm_and_its_torch(tmp_path):
    done = unsloth("install", "--dry-run", "--json", "--with", "vllm", "--from", str(LINUX_CUDA_DUMP), home=tmp_path)
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["vllm"]["source"] == "pypi" and plan["vllm"]["spec"].startswith("vllm==")
    assert plan["torch"]["version_spec"] == plan["vllm"]["torch"]
    plain = json.loads(unsloth("install", "--dry-run", "--json", "--from", str(LINUX_CUDA_DUMP), home=tmp_path).stdout)
    assert "vllm" not in plain and plain["torch"]["version_spec"] != plan["vllm"]["torch"]


def test_a_refused_vllm_stops_a_real_install_before_anything_is_written(tmp_path):
    """A matrix without vLLM rows refuses it on any machine (a GPU one too): nothing is built or written."""
    text = (REPO / "src" / "unsloth" / "hardware_matrix.toml").read_text(encoding="utf-8")
    before, after = text.split("\n[[vllm]]\n", 1)
    (tmp_path / "matrix.toml").write_text(before + "\n" + after.split("\n\n", 1)[1], encoding="utf-8")
    home = tmp_path / "home"
    home.mkdir()
    done = unsloth("install", "--yes", "--with", "vllm", home=home, UNSLOTH_MATRIX=str(tmp_path / "matrix.toml"))
    assert done.returncode == 2, done.stderr
    assert "--with vllm is refused: vLLM publishes no wheel for" in done.stderr and "fast generation path" in done.stderr
    assert "without --with vllm" in done.stderr and "Traceback" not in done.stderr
    assert list(home.iterdir()) == []


def test_an_unknown_opt_in_part_is_refused(tmp_path):
    done = unsloth("install", "--dry-run", "--with", "vllm,flash-attn", home=tmp_path)
    assert done.returncode == 2 and "--with flash-attn: not an opt-in part (vllm)" in done.stderr
    assert list(tmp_path.iterdir()) == []
