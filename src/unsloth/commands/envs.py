"""`unsloth env list | path | export`: where the managed environments are, and a lock of one."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


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


def _active_or_explain():
    from unsloth.envs import state
    from unsloth.envs.lock import InstallLock
    from unsloth.envs.paths import LOCK_NAME, active_env, home, pointer_problem
    from unsloth.errors import UnslothError

    root = home()
    problem = pointer_problem(root)
    if problem and any(receipt for _, receipt in state.list_envs(root)):  # under the lock: no install is switching now
        with InstallLock(root / LOCK_NAME):
            repaired = state.repair_current(root)
        print(f"unsloth env: {problem}; repaired: it names {repaired} again", file=sys.stderr)
    elif problem:
        raise UnslothError(problem, "run `unsloth install` (or install.sh): it builds an environment and "
                           "writes the pointer again", kept="no environment was touched")
    env = active_env(root)
    if env is None:
        print(f"unsloth env: no environment is installed under {home()}; run `unsloth install` "
              "(or install.sh) first.", file=sys.stderr)
    return env


def run_list(args: argparse.Namespace) -> int:
    from unsloth.envs.manager import env_table
    from unsloth.envs.paths import home

    rows = env_table(home())
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(f"No environments under {home()}.")
    for row in rows:
        mark = "*" if row["active"] else " "
        print(f"{mark} {row['name']}  {row['status']:<10} {row['backend'] or '-':<5} torch {row['torch'] or '-':<14} {row['path']}")
    return 0


def run_path(args: argparse.Namespace) -> int:
    from unsloth.envs.paths import env_python

    env = _active_or_explain()
    if env is None:
        return 1
    print(env_python(env) if args.python else env)
    return 0


def run_export(args: argparse.Namespace) -> int:
    from unsloth.envs.fsio import write_atomic
    from unsloth.envs.manager import export_lock

    env = _active_or_explain()
    if env is None:
        return 1
    try:
        text = export_lock(env)
    except ValueError as exc:  # a receipt from a newer unsloth, or damaged
        print(f"unsloth env export: {exc}; rebuild it with `unsloth install --force`.", file=sys.stderr)
        return 1
    if args.output:
        write_atomic(args.output, text)
        pinned = sum(1 for line in text.splitlines() if line and not line.startswith(("#", "--")))
        print(f"Wrote {args.output} ({pinned} packages) from {env.name}.", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
