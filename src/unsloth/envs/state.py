"""Which environment is active, and the atomic switches between them. Call under the install lock."""

from __future__ import annotations

import shutil
from pathlib import Path

from unsloth.envs.fsio import write_atomic
from unsloth.envs.paths import CURRENT, PREVIOUS, active_env, envs_dir, pointer_problem, previous_env
from unsloth.envs.processes import PIDFILE, reap
from unsloth.envs.receipt import Receipt, read_receipt


def switch(root: Path, name: str) -> None:
    """Make envs/<name> active; the one it replaces becomes the rollback target. One rename each."""
    old = active_env(root)
    if old is not None and old.name != name:
        write_atomic(root / PREVIOUS, old.name + "\n")
    write_atomic(root / CURRENT, name + "\n")


def rollback(root: Path) -> tuple[str, str] | None:
    """Swap current and previous; returns (from, to) or None when there is nothing to return to."""
    old, new = active_env(root), previous_env(root)
    if new is None:
        return None
    write_atomic(root / PREVIOUS, (old.name if old else new.name) + "\n")
    write_atomic(root / CURRENT, new.name + "\n")
    return (old.name if old else "-", new.name)


def list_envs(root: Path) -> list[tuple[Path, Receipt | None]]:
    folder = envs_dir(root)
    if not folder.is_dir():
        return []
    return [(env, read_receipt(env)) for env in sorted(folder.iterdir()) if env.is_dir()]


def remove_env(env: Path) -> bool:
    """Delete an environment folder; False when the OS refuses (Windows: a program still runs from it)."""
    shutil.rmtree(env, ignore_errors=True)
    return not env.exists()


def sweep(root: Path, keep_finished: bool = True) -> list[str]:
    """Remove unfinished builds (no receipt: a killed run) and, unless ``keep_finished``, every
    finished environment that is neither current nor previous. Returns the names removed.

    A killed run's step may still be running (uv compiling llama.cpp): it is ended first, or it
    would write into the folder again after it is deleted."""
    keep = {env.name for env in (active_env(root), previous_env(root)) if env is not None}
    removed = []
    for env, receipt in list_envs(root):
        if env.name in keep or (receipt is not None and keep_finished):
            continue
        if receipt is None:
            reap(env / "logs" / PIDFILE)
        if remove_env(env):
            removed.append(env.name)
    return removed


def repair_current(root: Path) -> str | None:
    """Point a damaged ``current`` at the previous environment, else the newest finished one. Returns
    the name it now names, or None when nothing needed repair or nothing is installed."""
    if pointer_problem(root) is None:
        return None
    finished = [(receipt.finished or "", env) for env, receipt in list_envs(root) if receipt is not None]
    chosen = previous_env(root) or max(finished, default=(None, None))[1]
    if chosen is None:
        return None
    write_atomic(root / CURRENT, chosen.name + "\n")
    return chosen.name
