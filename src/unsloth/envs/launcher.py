"""The ``unsloth`` launcher and the one PATH line that makes it found; both removable exactly.

The launcher reads the ``current`` pointer at every start, so switching or rolling back an
environment never touches it. Shell start-up files get one marked line each, never twice.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from unsloth.envs.fsio import write_atomic
from unsloth.envs.paths import CURRENT, is_windows

MARKER = "# added by the unsloth installer"


def launcher_path(bin_dir: Path) -> Path:
    return bin_dir / ("unsloth.cmd" if is_windows() else "unsloth")


def launcher_text(home: Path, windows: bool) -> str:
    if windows:
        return (
            f"@echo off\r\nrem {MARKER[2:]}; `unsloth uninstall` removes it.\r\nsetlocal\r\n"
            # The same message as the sh launcher's, rather than cmd's "not recognized" for a missing env.
            # Two plain lines, no ( ) block: a path with ")" or "&" in it would break one.
            f'if not exist "{home}\\{CURRENT}" echo unsloth: no environment is installed; run install.ps1 again 1>&2\r\n'
            f'if not exist "{home}\\{CURRENT}" exit /b 1\r\n'
            f'set /p UNSLOTH_ENV=<"{home}\\{CURRENT}"\r\n'
            f'"{home}\\envs\\%UNSLOTH_ENV%\\Scripts\\unsloth.exe" %*\r\n'
            "exit /b %ERRORLEVEL%\r\n"
        )
    quoted = shlex.quote(str(home))
    return (
        "#!/bin/sh\n"
        f"{MARKER}; `unsloth uninstall` removes it.\n"
        f"home={quoted}\n"
        f'read -r env < "$home/{CURRENT}" 2>/dev/null || {{\n'
        f'  echo "unsloth: no environment is installed in $home; run install.sh again" >&2; exit 1; }}\n'
        'exec "$home/envs/$env/bin/unsloth" "$@"\n'
    )


def is_ours(path: Path) -> bool:
    try:
        return MARKER[2:] in path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False


def write_launcher(home: Path, bin_dir: Path) -> Path:
    path = launcher_path(bin_dir)
    write_atomic(path, launcher_text(home, is_windows()))
    if not is_windows():
        path.chmod(0o755)
    return path


def path_line(bin_dir: Path) -> str:
    quoted = shlex.quote(str(bin_dir))
    return f'case ":$PATH:" in *:{quoted}:*) ;; *) export PATH={quoted}":$PATH" ;; esac  {MARKER}'


def login_shell(environ: dict[str, str] | None = None) -> str:
    """The user's shell by name ("bash", "zsh", "fish"), from SHELL; "" when unknown."""
    return Path((environ if environ is not None else os.environ).get("SHELL", "")).name


def rc_files(user_home: Path, shell: str = "") -> list[Path]:
    """Start-up files that get the PATH line: ~/.profile (login shells, sh), and each shell's own
    file where the user has it or uses that shell: a new bash window reads only ~/.bashrc, zsh only
    ~/.zshrc, and a login bash skips ~/.profile once ~/.bash_profile exists."""
    files = [user_home / ".profile"]
    wanted = {".bashrc": shell == "bash", ".zshrc": shell == "zsh", ".bash_profile": False}
    files += [user_home / name for name, used in wanted.items() if used or (user_home / name).exists()]
    return files


def fish_file(user_home: Path) -> Path:
    return user_home / ".config" / "fish" / "conf.d" / "unsloth.fish"


def add_to_path(bin_dir: Path, user_home: Path | None = None, shell: str | None = None) -> list[Path]:
    """Make ``bin_dir`` found by new shells; returns the files changed (none on a re-run)."""
    if is_windows():
        return [Path("HKCU\\Environment\\Path")] if _windows_path(bin_dir, add=True) else []
    user_home = user_home or Path.home()
    shell = login_shell() if shell is None else shell
    changed = []
    for rc in rc_files(user_home, shell):
        text = rc.read_text(encoding="utf-8") if rc.exists() else ""
        if MARKER in text:
            continue
        sep = "" if not text or text.endswith("\n") else "\n"
        rc.write_text(f"{text}{sep}{path_line(bin_dir)}\n", encoding="utf-8")
        changed.append(rc)
    fish = fish_file(user_home)
    if (shell == "fish" or fish.parent.parent.is_dir()) and not fish.exists():
        fish.parent.mkdir(parents=True, exist_ok=True)
        fish.write_text(f"{MARKER}\nfish_add_path -g {shlex.quote(str(bin_dir))}\n", encoding="utf-8")
        changed.append(fish)
    return changed


def remove_from_path(bin_dir: Path, user_home: Path | None = None) -> list[Path]:
    """Undo add_to_path: drop exactly the marked lines and our fish file."""
    if is_windows():
        return [Path("HKCU\\Environment\\Path")] if _windows_path(bin_dir, add=False) else []
    user_home = user_home or Path.home()
    changed = []
    for rc in [user_home / name for name in (".profile", ".bash_profile", ".bashrc", ".zshrc")]:
        if not rc.exists():
            continue
        text = rc.read_text(encoding="utf-8")
        kept = [line for line in text.splitlines(keepends=True) if MARKER not in line]
        if len(kept) != len(text.splitlines(keepends=True)):
            if "".join(kept).strip():
                rc.write_text("".join(kept), encoding="utf-8")
            else:  # it held only our line: we created it
                rc.unlink()
            changed.append(rc)
    fish = fish_file(user_home)
    if fish.exists() and MARKER in fish.read_text(encoding="utf-8"):
        fish.unlink()
        changed.append(fish)
    return changed


def _windows_path(bin_dir: Path, add: bool) -> bool:  # pragma: no cover - Windows only
    import winreg

    with winreg.OpenKey(winreg.HKEY_CURRENT_USER, "Environment", 0, winreg.KEY_READ | winreg.KEY_WRITE) as key:
        try:
            value, kind = winreg.QueryValueEx(key, "Path")
        except FileNotFoundError:
            value, kind = "", winreg.REG_EXPAND_SZ
        parts = [part for part in value.split(os.pathsep) if part]
        present = any(os.path.normcase(part) == os.path.normcase(str(bin_dir)) for part in parts)
        if add == present:
            return False
        parts = parts + [str(bin_dir)] if add else [p for p in parts if os.path.normcase(p) != os.path.normcase(str(bin_dir))]
        winreg.SetValueEx(key, "Path", 0, kind, os.pathsep.join(parts))
    return True
