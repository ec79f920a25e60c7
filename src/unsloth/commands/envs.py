"""`unsloth env list | path | export`: where the managed environments are, and a lock of one."""

from __future__ import annotations

import argparse
from pathlib import Path

from unsloth.commands.results import EnvListing, EnvLock, EnvPath, NoEnvironment
from unsloth.errors import UnslothError


def register(subparsers) -> None:
    parser = subparsers.add_parser("env", help="list the managed environments, print a path, export a lock")
    sub = parser.add_subparsers(dest="env_command", metavar="ACTION", required=True)
    listing = sub.add_parser("list", help="every environment, the active one marked")
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(func=run_list)
    path = sub.add_parser("path", help="the active environment's folder (or --python: its interpreter)")
    path.add_argument("--python", action="store_true", help="print the interpreter instead")
    path.set_defaults(func=run_path)
    export = sub.add_parser("export", help="write a requirements lock that rebuilds the active environment exactly")
    export.add_argument("-o", "--output", type=Path, metavar="FILE", help="write here instead of standard output")
    export.set_defaults(func=run_export)


def _active_or_explain() -> tuple[Path | None, tuple[str, ...]]:
    """(the active environment or None, what was repaired to find it)."""
    from unsloth.envs import state
    from unsloth.envs.lock import InstallLock
    from unsloth.envs.paths import LOCK_NAME, active_env, home, pointer_problem

    root = home()
    problem = pointer_problem(root)
    notes: tuple[str, ...] = ()
    if problem and any(receipt for _, receipt in state.list_envs(root)):  # under the lock: no install is switching now
        with InstallLock(root / LOCK_NAME):
            repaired = state.repair_current(root)
        notes = (f"unsloth env: {problem}; repaired: it names {repaired} again",)
    elif problem:
        raise UnslothError(problem, "run `unsloth install` (or install.sh): it builds an environment and "
                           "writes the pointer again", kept="no environment was touched")
    return active_env(root), notes


def run_list(args: argparse.Namespace) -> EnvListing:
    from unsloth.envs.manager import env_table
    from unsloth.envs.paths import home

    return EnvListing(env_table(home()), home())


def run_path(args: argparse.Namespace) -> EnvPath | NoEnvironment:
    from unsloth.envs.paths import env_python, home

    env, notes = _active_or_explain()
    if env is None:
        return NoEnvironment(home(), notes)
    return EnvPath(env_python(env) if args.python else env, notes)


def run_export(args: argparse.Namespace) -> EnvLock | NoEnvironment:
    from unsloth.envs.fsio import write_atomic
    from unsloth.envs.manager import export_lock
    from unsloth.envs.paths import home

    env, notes = _active_or_explain()
    if env is None:
        return NoEnvironment(home(), notes)
    try:
        text = export_lock(env)
    except ValueError as exc:  # a receipt from a newer unsloth, or damaged
        raise UnslothError(str(exc), "rebuild it with `unsloth install --force`", kept="nothing was written") from exc
    if args.output:
        write_atomic(args.output, text)
    return EnvLock(text, env.name, args.output, notes)
