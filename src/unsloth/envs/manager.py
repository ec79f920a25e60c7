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
from rich.markup import escape

from unsloth.envs import launcher, state
from unsloth.envs.build import BuildFailed, build, default_python, has_newer, request_hash, source_identity
from unsloth.envs.lock import InstallLock
from unsloth.envs.paths import CACHE, CURRENT, LOCK_NAME, PREVIOUS, active_env, bin_dir, is_windows
from unsloth.envs.receipt import hardware_fingerprint, read_receipt
from unsloth.envs.runner import StepFailed
from unsloth.envs.sources import Sources, parse_pip_config
from unsloth.envs.steps import DIST_NAME, Request
from unsloth.errors import UsageError
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


def _size(n: int) -> str:
    return f"{n / 1024**3:.1f} GB" if n >= 1024**3 else f"{n / 1024**2:.0f} MB"


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


def install(options: Options, plan, platform, console: Console, confirm: Callable[[], bool] | None = None) -> int:
    """Build and switch to a new environment unless the active one already matches; ``confirm`` asks first."""
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
            _expose(options, console)
            console.print(f"[green]Up to date[/]: {current.name} already matches this plan ({plan.torch.backend}). Nothing to do.")
            return 0
        if options.upgrade and receipt and receipt.request_hash == wanted and not options.force:
            with console.status("Checking the package indexes for newer versions"):
                newer = has_newer(current, request, plan)
            if newer is False:  # decided before anything is built
                _expose(options, console)
                console.print(f"[green]Up to date[/]: {current.name} already has the newest versions for this plan.")
                return 0
        if confirm is not None and not confirm():
            console.print("Nothing changed.")
            return 1
        console.print(f"Building a new environment beside {'the current one' if current else 'nothing'} …")
        try:
            env = build(root, request, plan, platform, console, use_pip=options.use_pip)
        except StepFailed as exc:
            # Tool output is not markup: pip's "[notice]" would vanish, a "[/path]" would raise.
            console.print(f"[red]✗ {escape(exc.step.title)} failed[/]\n{escape(exc.tail)}\n")
            console.print(f"Full log: {escape(str(exc.log))}  (that build was removed)")
            console.print(f"Likely fix: {escape(exc.fix)}")
            return _kept(current, console)
        except BuildFailed as exc:
            console.print(f"[red]✗ {escape(str(exc))}[/]")
            for problem in exc.found:
                console.print(f"  - {escape(problem)}")
            console.print(f"Logs: {escape(str(exc.log))}  (that build was removed)")
            console.print(f"Likely fix: {escape(exc.fix)}")
            return _kept(current, console)
        except KeyboardInterrupt:
            console.print("[yellow]Interrupted[/]: the half-built environment was removed.")
            _kept(current, console)
            return 130
        same = receipt and receipt.request_hash == wanted and read_receipt(env).packages == receipt.packages
        if options.upgrade and same:
            state.remove_env(env)  # identical to what is active: keep the active one, which is proven
            _expose(options, console)
            console.print(f"[green]Up to date[/]: {current.name} already has the newest versions for this plan.")
            return 0
        state.switch(root, env.name)
        state.sweep(root, keep_finished=False)
        _expose(options, console)
    console.print(f"[green]Ready[/]: environment {env.name} is active ({plan.torch.backend}).")
    if current:
        console.print(f"The previous one ({current.name}) is kept: `unsloth rollback` returns to it.")
    return 0


def _kept(current: Path | None, console: Console) -> int:
    if current:
        console.print(f"Nothing changed: {current.name} is still the active environment.")
    else:
        console.print("Nothing was installed; your system is as it was.")
    return 1


def _expose(options: Options, console: Console) -> None:
    """The launcher and the PATH line; both idempotent."""
    target = bin_dir()
    path = launcher.write_launcher(options.root, target)
    if options.modify_path:
        for changed in launcher.add_to_path(target):
            console.print(f"Added {target} to PATH in {changed}")
    on_path = str(target) in os.environ.get("PATH", "").split(os.pathsep)
    if not on_path:
        now = "" if is_windows() else f' (or run: export PATH="{target}:$PATH")'  # Windows: the user PATH is set
        console.print(f"Open a new terminal{now} to use `{path.name}`.")


def rollback(root: Path, console: Console) -> int:
    with locked(root, console):
        swapped = state.rollback(root)
    if swapped is None:
        console.print("Nothing to roll back to: there is no previous environment.")
        return 1
    console.print(f"Rolled back: {swapped[1]} is active again (was {swapped[0]}; `unsloth rollback` swaps back).")
    return 0


def uninstall(root: Path, console: Console, purge: bool = False) -> int:
    """Remove the environments, the bootstrap env, the launcher and the PATH line; nothing else.

    This usually runs from inside the environment it deletes: everything is printed first, and
    nothing is imported after the deletion starts.
    """
    script = launcher.launcher_path(bin_dir())
    folders = [root / name for name in ("envs", "bootstrap", "uv", "logs") if (root / name).exists()]
    ours = launcher.is_ours(script)  # never delete an `unsloth` we did not write
    for path in ([script] if ours else []) + folders + ([root] if purge else []):
        console.print(f"removing {path}")
    caches = [row for row in kept_caches(root) if not (purge and row[1].is_relative_to(root))]
    with locked(root, console):
        for changed in launcher.remove_from_path(bin_dir()):
            console.print(f"removed the PATH line from {changed}")
        console.print("[green]Uninstalled[/]; your training outputs are kept.")
        for what, path, size in caches:
            console.print(f"  kept {escape(str(path))} ({_size(size)}): {escape(what)}")
        console.file.flush()
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
    return 0


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
