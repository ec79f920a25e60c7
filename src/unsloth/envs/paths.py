"""Where managed environments live and which one is active. Reads only; never writes.

Under the install home (``UNSLOTH_HOME``, default: the platformdirs user data dir): ``envs/<name>/``
(one environment per build, never moved; finished once ``receipt.json`` is written), and the
``current`` / ``previous`` pointers, one line each naming an env. The pointers are plain text so
that the launcher (sh or cmd) can read them and a switch is one atomic rename on every OS.
The full layout is in docs/environment.md.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import platformdirs

RECEIPT_NAME = "receipt.json"
CURRENT = "current"
PREVIOUS = "previous"
LOCK_NAME = "install.lock"
CACHE = "cache"  # <home>/cache/{uv,pip}: our builds' downloads and built wheels
# What a fresh environment takes on disk, by torch backend: torch with its bundled runtime (ROCm's is the
# largest), uv's cached copy of the wheels, the training stack and one small model download. `unsloth
# install` refuses to start with less free; doctor's disk check says the same.
ENV_DISK_GIB = {"cuda": 12, "rocm": 30, "xpu": 12, "cpu": 4, "mps": 4}


def build_caches(root: Path, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The cache folders every install step uses: ours, under the install home (so `uninstall`
    can say how large they are and `uninstall --purge` removes them), unless the user chose one."""
    environ = os.environ if environ is None else environ
    return {name: environ.get(name) or str(root / CACHE / tool) for name, tool in (("UV_CACHE_DIR", "uv"), ("PIP_CACHE_DIR", "pip"))}


def is_windows() -> bool:
    return sys.platform == "win32"


def home() -> Path:
    """The install home: ``UNSLOTH_HOME`` or the user data dir (~/.local/share/unsloth, %LOCALAPPDATA%\\unsloth)."""
    override = os.environ.get("UNSLOTH_HOME")
    if override:
        return Path(override).expanduser().absolute()
    return Path(platformdirs.user_data_dir("unsloth", appauthor=False))


def envs_dir(root: Path | None = None) -> Path:
    return (root or home()) / "envs"


def bin_dir() -> Path:
    """Where the ``unsloth`` launcher goes: ``UNSLOTH_BIN_DIR``, else ~/.local/bin (Windows: <home>\\bin)."""
    override = os.environ.get("UNSLOTH_BIN_DIR")
    if override:
        return Path(override).expanduser().absolute()
    if is_windows():
        return home() / "bin"
    return Path.home() / ".local" / "bin"


def env_scripts(env: Path) -> Path:
    return env / ("Scripts" if is_windows() else "bin")


def env_python(env: Path) -> Path:
    """The interpreter of a managed environment (it need not exist)."""
    return env_scripts(env) / ("python.exe" if is_windows() else "python")


def _pointed(root: Path, pointer: str) -> Path | None:
    try:
        name = (root / pointer).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):  # missing, or garbage: no environment (pointer_problem says which)
        return None
    env = envs_dir(root) / name
    if not name or os.sep in name or "/" in name or not (env / RECEIPT_NAME).is_file():
        return None
    return env


def active_env(root: Path | None = None) -> Path | None:
    """The environment ``unsloth`` runs in, or None when nothing finished installing."""
    return _pointed(root or home(), CURRENT)


def previous_env(root: Path | None = None) -> Path | None:
    """The environment ``unsloth rollback`` returns to, or None."""
    return _pointed(root or home(), PREVIOUS)


def pointer_problem(root: Path | None = None) -> str | None:
    """What is wrong with a ``current`` pointer that exists but names no finished environment; None otherwise."""
    root = root or home()
    pointer = root / CURRENT
    if not pointer.is_file() or active_env(root) is not None:
        return None
    try:
        text = pointer.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return f"{pointer} is damaged (not a line of text)"
    shown = text[:60] + ("…" if len(text) > 60 else "")
    return f"{pointer} is damaged: it names {shown!r}, which is no finished environment in {envs_dir(root)}"
