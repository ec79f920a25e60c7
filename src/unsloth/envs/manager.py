"""install, update, rollback, uninstall: each one transaction under the install lock.

The active environment changes only by an atomic rename of the ``current`` pointer, after the new
environment is built and verified; everything else that can fail happens before that.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from rich.console import Console

from unsloth.envs import launcher, state
from unsloth.envs.build import BuildFailed, build, default_python, has_newer, request_hash, source_identity
from unsloth.envs.lock import InstallLock
from unsloth.envs.outcomes import (BuildInterrupted, BuildRefused, Declined, Exposure, Installed, NothingToRollBack,
                                   RolledBack, Uninstalled, UpToDate)
from unsloth.envs.paths import CACHE, CURRENT, ENV_DISK_GIB, LOCK_NAME, PREVIOUS, active_env, bin_dir, is_windows
from unsloth.envs.receipt import hardware_fingerprint, read_receipt
from unsloth.envs.runner import StepFailed
from unsloth.envs.sources import Sources, parse_pip_config
from unsloth.envs.steps import DIST_NAME, Request
from unsloth.errors import UnslothError, UsageError
from unsloth.interrupts import signals_as_interrupt

def folder_size(path: Path) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total


def kept_caches(root: Path, environ=os.environ) -> list[tuple[str, Path, int]]:
    """What `uninstall` leaves: (what it is and how to remove it, folder, bytes), for folders that exist."""
    hf = Path(environ.get("HF_HOME") or Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface")
    rows = [("our build caches (uv and pip downloads); `unsloth uninstall --purge` removes them", root / CACHE),
            ("Hugging Face models and datasets: yours, kept", hf)]
    for name, tool in (("UV_CACHE_DIR", "uv cache clean"), ("PIP_CACHE_DIR", "pip cache purge")):
        if environ.get(name):
            rows.append((f"the cache you chose with {name}: kept (`{tool}` empties it)", Path(environ[name])))
    return [(what, path, folder_size(path)) for what, path in rows if path.is_dir()]


@dataclass
class Options:
    """Everything `unsloth install` / `update` were asked, besides the plan."""

    request: Request
    root: Path
    use_pip: bool = False
    force: bool = False
    modify_path: bool = True
    upgrade: bool = False  # `update`: build even when nothing was asked differently


def pip_config_sources(python: str | None = None) -> Sources:
    """The user's pip configuration (files and PIP_* variables), read by pip itself."""
    for candidate in filter(None, (python, sys.executable, default_python(), shutil.which("pip3"), shutil.which("pip"))):
        argv = [candidate, "config", "list"] if Path(candidate).stem.startswith("pip") else [candidate, "-m", "pip", "config", "list"]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0:
            return parse_pip_config(done.stdout)
    return Sources()


def python_tag(python: str | None = None) -> str:
    """The CPython wheel tag (cp312) of the interpreter an environment would be built on."""
    if python is None:
        return f"cp{sys.version_info[0]}{sys.version_info[1]}"
    code = "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')"
    try:
        done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        done = None
    if done is None or done.returncode != 0:
        raise UsageError(f"--python {python}: cannot run it", "pass an interpreter that starts, e.g. --python python3.12")
    return done.stdout.strip()


def find_source(explicit: str | None, root: Path) -> str | None:
    """Where this package is installed from: --source, this checkout, or what the active env used."""
    if explicit:
        return str(Path(explicit).absolute()) if "://" not in explicit else explicit
    checkout = Path(__file__).resolve().parents[3]
    pyproject = checkout / "pyproject.toml"
    if pyproject.is_file() and f'name = "{DIST_NAME}"' in pyproject.read_text(encoding="utf-8"):
        return str(checkout)
    env = active_env(root)
    receipt = read_receipt(env) if env else None
    return receipt.unsloth.get("source") if receipt else None


def active_request(root: Path) -> dict:
    """What the active environment was built from (its receipt's request), or {}."""
    env = active_env(root)
    receipt = read_receipt(env) if env else None
    return receipt.request if receipt else {}


def locked(root: Path, console: Console) -> InstallLock:
    def waiting(holder: str) -> None:
        console.print(f"Another unsloth install is running (pid {holder}); waiting for it to finish…")

    return InstallLock(root / LOCK_NAME, on_wait=waiting)


def install(options: Options, plan, platform, console: Console, confirm: Callable[[], bool] | None = None
            ) -> Installed | UpToDate | Declined | BuildRefused | BuildInterrupted:
    """Build and switch to a new environment unless the active one already matches; ``confirm`` asks first.

    Progress goes to ``console``; the outcome is returned (``unsloth.envs.outcomes``).
    """
    root, request = options.root, options.request
    with locked(root, console), signals_as_interrupt():
        swept = state.sweep(root)
        if swept:
            console.print(f"Removed unfinished builds left by an interrupted run: {', '.join(swept)}")
        current = active_env(root)
        receipt = read_receipt(current) if current else None
        wanted = request_hash(
            request, plan.to_json(), source_identity(request.source), hardware_fingerprint(platform.to_json())
        )
        if receipt and receipt.request_hash == wanted and not (options.force or options.upgrade):
            return UpToDate(current.name, plan.torch.backend, _expose(options))
        if options.upgrade and receipt and receipt.request_hash == wanted and not options.force:
            with console.status("Checking the package indexes for newer versions"):
                newer = has_newer(current, request, plan)
            if newer is False:  # decided before anything is built
                return UpToDate(current.name, plan.torch.backend, _expose(options), newest=True)
        enough_disk(root, plan.torch.backend, current)  # before asking, and before anything is written
        if confirm is not None and not confirm():
            return Declined()
        console.print(f"Building a new environment beside {'the current one' if current else 'nothing'} …")
        kept = current.name if current else None
        try:
            env = build(root, request, plan, platform, console, use_pip=options.use_pip)
        except StepFailed as exc:
            return BuildRefused(f"{exc.step.title} failed", exc.fix, exc.log, kept, tail=exc.tail)
        except BuildFailed as exc:
            return BuildRefused(exc.problem, exc.fix, exc.log, kept, found=tuple(exc.found))
        except KeyboardInterrupt:
            return BuildInterrupted(kept)
        same = receipt and receipt.request_hash == wanted and read_receipt(env).packages == receipt.packages
        if options.upgrade and same:
            state.remove_env(env)  # identical to what is active: keep the active one, which is proven
            return UpToDate(current.name, plan.torch.backend, _expose(options), newest=True)
        state.switch(root, env.name)
        state.sweep(root, keep_finished=False)
        exposure = _expose(options)
    return Installed(env.name, plan.torch.backend, exposure, previous=kept)


def enough_disk(root: Path, backend: str, current: Path | None) -> None:
    """Refuse a build the disk under the install home cannot hold (a full disk mid-build is caught
    again by the step that hits it: its likely fix says so)."""
    need = ENV_DISK_GIB.get(backend, ENV_DISK_GIB["cpu"])
    folder = next(path for path in (root, *root.parents) if path.exists())
    free = shutil.disk_usage(folder).free
    if free < need * 1024**3:
        kept = f"nothing changed: {current.name} is still the active environment" if current else "nothing was installed"
        raise UnslothError(f"not enough free disk for a {backend} environment: {free / 1024**3:.1f} GiB free in "
                           f"{folder}, it needs about {need} GiB", "free some space there, or set UNSLOTH_HOME to a "
                           f"folder on a disk with {need} GiB free", kept=kept)


def _expose(options: Options) -> Exposure:
    """The launcher and the PATH line; both idempotent."""
    target = bin_dir()
    path = launcher.write_launcher(options.root, target)
    added = tuple(launcher.add_to_path(target)) if options.modify_path else ()
    on_path = str(target) in os.environ.get("PATH", "").split(os.pathsep)
    return Exposure(path, target, added, on_path, is_windows())


def rollback(root: Path, console: Console) -> RolledBack | NothingToRollBack:
    with locked(root, console):
        swapped = state.rollback(root)
    if swapped is None:
        return NothingToRollBack()
    return RolledBack(active=swapped[1], was=swapped[0])


def uninstall(root: Path, console: Console, purge: bool = False) -> Uninstalled:
    """Remove the environments, the bootstrap env, the launcher and the PATH line; nothing else.

    This usually runs from inside the environment it deletes: what it removes and keeps is worked out
    first, and nothing is imported after the deletion starts (the renderer prints with what is loaded).
    """
    script = launcher.launcher_path(bin_dir())
    folders = [root / name for name in ("envs", "bootstrap", "uv", "logs") if (root / name).exists()]
    ours = launcher.is_ours(script)  # never delete an `unsloth` we did not write
    removed = tuple(([script] if ours else []) + folders + ([root] if purge else []))
    caches = tuple(row for row in kept_caches(root) if not (purge and row[1].is_relative_to(root)))
    with locked(root, console):
        unlisted = tuple(launcher.remove_from_path(bin_dir()))
        if ours:
            script.unlink(missing_ok=True)
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
        for name in (CURRENT, PREVIOUS):
            (root / name).unlink(missing_ok=True)
    (root / LOCK_NAME).unlink(missing_ok=True)
    if purge:
        shutil.rmtree(root, ignore_errors=True)
    for folder in (root, bin_dir()):
        _remove_empty_up_to_home(folder)
    return Uninstalled(removed, unlisted, caches)


def _remove_empty_up_to_home(folder: Path) -> None:
    """Folders we created (~/.local/bin, ~/.local/share/unsloth) go too, if nothing else is in them."""
    stop = Path.home()
    while folder != stop and stop in folder.parents and folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
        folder = folder.parent


def env_table(root: Path) -> list[dict]:
    current = active_env(root)
    rows = []
    for env, receipt in state.list_envs(root):
        rows.append(
            {
                "name": env.name,
                "path": str(env),
                "active": current is not None and env == current,
                "finished": receipt.finished if receipt else None,
                "backend": receipt.backend if receipt else None,
                "torch": receipt.packages.get("torch") if receipt else None,
                "status": "ready" if receipt else "unfinished",
            }
        )
    return rows


def export_lock(env: Path) -> str:
    """A requirements file that rebuilds ``env`` exactly: every version pinned, torch from its source."""
    receipt = read_receipt(env)
    if receipt is None:
        raise ValueError(f"{env}: its receipt is missing, unreadable or from a newer unsloth")
    indexes = receipt.indexes
    torch = indexes.get("torch") or {}
    lines = [
        f"# unsloth environment {receipt.name}, built {receipt.finished} ({receipt.backend})",
        "# Rebuild it exactly in a fresh environment: pip install -r THIS_FILE",
        "# (uv: uv pip install --index-strategy unsafe-best-match -r THIS_FILE)",
    ]
    if torch.get("mode") == "index" and torch.get("url"):
        lines.append(f"--extra-index-url {torch['url']}")
    if indexes.get("index_url"):
        lines.append(f"--index-url {indexes['index_url']}")
    lines += [f"--extra-index-url {url}" for url in indexes.get("extra_index_urls", [])]
    wheelhouses = indexes.get("find_links", []) + ([torch["url"]] if torch.get("mode") == "wheelhouse" else [])
    lines += [f"--find-links {link}" for link in dict.fromkeys(wheelhouses)]
    source = receipt.unsloth["source"]
    source_url = source if "://" in source else Path(source).as_uri()
    for name, version in sorted(receipt.packages.items()):
        lines.append(f"{DIST_NAME} @ {source_url}" if name == DIST_NAME else f"{name}=={version}")
    return "\n".join(lines) + "\n"


__all__ = ["Options", "install", "rollback", "uninstall", "env_table", "export_lock", "pip_config_sources", "find_source"]
