"""A sandboxed HOME and a frozen copy of this source tree, for running the real installers.

(A uniquely named helper module, not conftest.py, so that other test folders' conftests never clash.)

Downloads are shared between runs through uv's and pip's caches (outside the sandbox), so a
second test run installs from cache; the sandbox itself starts empty every time.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def cache_dir(name: str, tmp_root: Path) -> str:
    """The caller's cache if it set one, else one that outlives this session's temp folder."""
    return os.environ.get(f"{name}_CACHE_DIR") or str(tmp_root.parent / f"unsloth-test-{name.lower()}-cache")


@dataclass
class Sandbox:
    home: Path  # the user's HOME
    source: Path  # a copy of this repository: what "a clone" is for install.sh
    env: dict[str, str]

    @property
    def unsloth_home(self) -> Path:
        return self.home / ".local" / "share" / "unsloth"

    @property
    def launcher(self) -> Path:
        return self.home / ".local" / "bin" / "unsloth"

    def current(self) -> str | None:
        pointer = self.unsloth_home / "current"
        return pointer.read_text().strip() if pointer.exists() else None

    def envs(self) -> list[str]:
        folder = self.unsloth_home / "envs"
        return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []

    def run(self, argv: list[str], timeout: float = 900, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(argv, env=env or self.env, capture_output=True, text=True, timeout=timeout, cwd=self.home)

    def files(self) -> set[str]:
        """Every path under HOME but the caches we pointed elsewhere anyway."""
        return {str(p.relative_to(self.home)) for p in self.home.rglob("*") if ".cache" not in p.relative_to(self.home).parts}


def copy_source(dest: Path) -> Path:
    """The tracked and untracked-but-not-ignored files, as a clone would have them."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                            check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = REPO / rel
        if src.is_file():
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)
    return dest


def sandbox_env(home: Path, tmp_root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UNSLOTH_", "XDG_", "VIRTUAL_ENV", "PYTHONPATH"))}
    # Not the test runner's own venv: install.sh must find a Python the way a user's shell would.
    venv_bin = str(Path(sys.prefix) / "bin")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p and p != venv_bin)
    env.update(HOME=str(home), UV_CACHE_DIR=cache_dir("UV", tmp_root), PIP_CACHE_DIR=cache_dir("PIP", tmp_root),
               NO_COLOR="1", COLUMNS="200")
    # pip runs `rustc --version` for its User-Agent; a rustup proxy then writes ~/.rustup. The sandbox
    # user shares the machine's toolchains, as it shares its caches, so that lands where they are.
    for name, default in (("RUSTUP_HOME", ".rustup"), ("CARGO_HOME", ".cargo")):
        real = os.environ.get(name) or str(Path.home() / default)
        if Path(real).is_dir():
            env[name] = real
    return env


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> Sandbox:
    """An empty HOME (but a .bashrc of the user's own) and a copy of this clone."""
    root = tmp_path_factory.mktemp("installer")
    home = root / "home"
    home.mkdir()
    (home / ".bashrc").write_text("# the user's own settings\nexport EDITOR=vi\n")
    return Sandbox(home=home, source=copy_source(root / "src"), env=sandbox_env(home, tmp_path_factory.getbasetemp()))
