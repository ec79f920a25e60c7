"""install.sh on a machine whose Python cannot make a venv with pip (Debian without python3-venv):
uv, found on PATH, makes the bootstrap environment and installs into it."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
from installers_sandbox import sandbox  # noqa: F401  (the module fixture)

pytestmark = [pytest.mark.slow, pytest.mark.network]


def test_no_pip_python_goes_through_uv(sandbox, tmp_path):
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    assert uv, "uv is a test dependency (pip install uv)"
    # A python3 whose standard library lacks ensurepip, as Debian ships it without python3-venv.
    shadow = tmp_path / "no-ensurepip"
    shadow.mkdir()
    (shadow / "ensurepip.py").write_text("raise ImportError('ensurepip is not installed (python3-venv)')\n")
    tools = tmp_path / "bin"
    tools.mkdir()
    os.symlink(uv, tools / "uv")
    env = {**sandbox.env, "PATH": f"{tools}{os.pathsep}{sandbox.env['PATH']}", "PYTHONPATH": str(shadow)}
    done = sandbox.run(["sh", str(sandbox.source / "install.sh"), "--yes", "--without", "llama-cpp"], env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Creating the bootstrap environment with uv" in done.stderr
    bootstrap = sandbox.unsloth_home / "bootstrap"
    assert not (bootstrap / "bin" / "pip").exists() and (bootstrap / "bin" / "uv").exists()
    assert "Ready" in done.stdout and sandbox.current() is not None
