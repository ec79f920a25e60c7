"""`unsloth install | update | rollback | uninstall`: the managed environment, transactionally.

`install --dry-run` only prints the plan (what would be installed, and why). Options can also come
from UNSLOTH_* variables, which is how `curl ... | sh` passes them (docs/install.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from unsloth.commands import render
from unsloth.commands.detect import add_from_argument, detect_platform
from unsloth.commands import results as r
from unsloth.envs.steps import OPTIONAL_PARTS
from unsloth.errors import UsageError
from unsloth.plan.vllm import WITH_PARTS


def _env_list(name: str) -> list[str]:
    return [item for item in os.environ.get(name, "").replace(",", " ").split() if item]


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def _add_build_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--yes", "-y", action="store_true", help="do not ask before building (implied without a terminal)")
    parser.add_argument("--source", default=os.environ.get("UNSLOTH_SOURCE"), metavar="PATH|URL",
                        help="install this package from a source tree or release archive "
                        "(default: this checkout, else what the active environment came from)")
    parser.add_argument("--python", default=os.environ.get("UNSLOTH_PYTHON"), metavar="PYTHON",
                        help="interpreter for the environment (default: the one running unsloth)")
    parser.add_argument("--index-url", default=os.environ.get("UNSLOTH_INDEX_URL"), metavar="URL",
                        help="package index for everything but PyTorch (default: your pip configuration, else PyPI)")
    parser.add_argument("--extra-index-url", action="append", default=_env_list("UNSLOTH_EXTRA_INDEX_URL"), metavar="URL")
    parser.add_argument("--find-links", action="append", default=_env_list("UNSLOTH_FIND_LINKS"), metavar="DIR|URL",
                        help="a wheelhouse; with the exact PyTorch build in it, PyTorch comes from there (air-gapped installs)")
    parser.add_argument("--ignore-pip-config", action="store_true", default=_env_flag("UNSLOTH_IGNORE_PIP_CONFIG"),
                        help="do not read pip's configuration for indexes, find-links and constraints")
    parser.add_argument("--without", action="append", default=_env_list("UNSLOTH_WITHOUT"), metavar="PART",
                        help=f"leave out an optional part: {', '.join(OPTIONAL_PARTS)} (repeatable or comma-separated)")
    parser.add_argument("--with", dest="with_parts", action="append", default=_env_list("UNSLOTH_WITH"), metavar="PART",
                        help=f"add an opt-in part: {', '.join(WITH_PARTS)} (GRPO rollouts for fast_inference=True; "
                        "Linux/WSL with an NVIDIA GPU, where its wheels exist; it pins the torch)")
    parser.add_argument("--pip", action="store_true", default=os.environ.get("UNSLOTH_INSTALLER") == "pip",
                        help="install with pip instead of uv")
    parser.add_argument("--no-modify-path", action="store_true", default=_env_flag("UNSLOTH_NO_MODIFY_PATH"),
                        help="do not add the launcher's folder to PATH in shell start-up files")


def register(subparsers) -> None:
    install = subparsers.add_parser(
        "install", help="build the environment for this machine's GPU (or --dry-run: show the plan)",
        description="Detect the hardware, plan, and build a managed environment beside the current one; "
        "switch to it only once it is verified.")
    install.add_argument("--dry-run", action="store_true", help="print the plan and change nothing")
    install.add_argument("--json", action="store_true", help="with --dry-run: print the plan as JSON")
    install.add_argument("--torch-index-url", default=None, metavar="URL",
                         help="take PyTorch from this index (a mirror of the plan's); also UNSLOTH_TORCH_INDEX_URL")
    install.add_argument("--force", action="store_true", help="rebuild even when the active environment matches")
    add_from_argument(install)
    _add_build_arguments(install)
    install.set_defaults(func=run_install, upgrade=False)

    update = subparsers.add_parser(
        "update", help="rebuild with the newest versions for this machine; keeps the current env if nothing changed",
        description="Re-detect, re-plan and build with fresh versions beside the current environment.")
    update.add_argument("--torch-index-url", default=None, metavar="URL")
    _add_build_arguments(update)
    update.set_defaults(func=run_install, upgrade=True, dry_run=False, json=False, force=False, from_dir=None)

    rollback = subparsers.add_parser("rollback", help="return to the previous environment")
    rollback.set_defaults(func=run_rollback)

    uninstall = subparsers.add_parser(
        "uninstall", help="remove the environments, the launcher and the PATH line (nothing else)")
    uninstall.add_argument("--yes", "-y", action="store_true", help="do not ask")
    uninstall.add_argument("--purge", action="store_true", help="also delete everything else under the install home")
    uninstall.set_defaults(func=run_uninstall)


def make_plan(args: argparse.Namespace):
    from unsloth.matrix import load_matrix
    from unsloth.plan import Overrides, resolve

    platform, _ = detect_platform(args.from_dir)
    overrides = Overrides.from_env(os.environ)
    if args.torch_index_url:
        overrides = dataclasses.replace(overrides, torch_index_url=args.torch_index_url)
    return platform, resolve(platform, load_matrix(), overrides=overrides, with_parts=args.with_parts)


def optional_parts(values: list[str]) -> list[str]:
    """--without as given (repeated, comma- or space-separated) -> the parts, each checked."""
    parts = [part for value in values for part in value.replace(",", " ").split()]
    unknown = sorted(set(parts) - set(OPTIONAL_PARTS))
    if unknown:
        raise UsageError(f"--without {', '.join(unknown)}: not an optional part ({', '.join(OPTIONAL_PARTS)})",
                         f"leave out only those, e.g. --without {','.join(OPTIONAL_PARTS)}", kept="nothing was changed")
    return parts


def opt_in_parts(values: list[str]) -> list[str]:
    """--with as given (repeated, comma- or space-separated) -> the parts, each checked."""
    parts = sorted({part for value in values for part in value.replace(",", " ").split()})
    unknown = sorted(set(parts) - set(WITH_PARTS))
    if unknown:
        raise UsageError(f"--with {', '.join(unknown)}: not an opt-in part ({', '.join(WITH_PARTS)})",
                         f"add only those, e.g. --with {','.join(WITH_PARTS)}", kept="nothing was changed")
    return parts


def refuse_unavailable(plan) -> None:
    """An opt-in part the plan cannot install stops the install before anything is built: never dropped."""
    if plan.vllm is not None and not plan.vllm.available:
        raise UsageError(plan.vllm.note, "run `unsloth install` without --with vllm (and UNSLOTH_WITH unset)",
                         kept="nothing was installed")


def run_install(args: argparse.Namespace) -> (r.PlanReport | r.Installed | r.UpToDate | r.BuildRefused
                                              | r.BuildInterrupted | r.Declined):
    if args.json and not args.dry_run:  # never start a build when only the plan was asked for
        raise UsageError("--json prints the plan", "add --dry-run")
    args.without = optional_parts(args.without)
    args.with_parts = opt_in_parts(args.with_parts)
    if args.upgrade and not args.with_parts:  # `update` keeps what the active environment opted into
        from unsloth.envs import manager
        from unsloth.envs.paths import home

        args.with_parts = opt_in_parts(manager.active_request(home()).get("with", []))
    platform, plan = make_plan(args)  # an unreadable dump or matrix is a UsageError / MatrixError naming it
    if args.dry_run:  # for a dump, this machine's pip configuration says nothing about that one's sources
        return r.PlanReport(plan, None if args.from_dir is not None else _install_sources(args, plan))
    if args.from_dir is not None:
        raise UsageError("--from plans for another machine's dump", "add --dry-run to see that plan",
                         kept="nothing was installed")
    refuse_unavailable(plan)

    from unsloth.envs import manager
    from unsloth.envs.paths import home
    from unsloth.envs.steps import Request

    root = home()
    source = manager.find_source(args.source, root)
    if source is None:
        raise UsageError("where should unsloth be installed from? No checkout or active environment names it",
                         "pass --source PATH|URL (a checkout or a release archive)")
    if "://" not in source and not os.path.exists(source):  # before PyTorch is downloaded, not after
        raise UsageError(f"the package source {source} does not exist (no such file or folder)",
                         "pass --source PATH|URL (a checkout or a release archive)", kept="nothing was installed")
    if args.upgrade and not args.without:  # `update` keeps what the active environment left out
        args.without = manager.active_request(root).get("without", [])
    sources, _ = _package_sources(args)
    request = Request(source=source, sources=sources, without=tuple(sorted(set(args.without))), python=args.python,
                      torch_index_url=_torch_index_url(args), with_parts=tuple(args.with_parts))
    console = render.progress_console()
    render.plan_summary(console, plan)
    confirm = None
    if not args.yes and sys.stdin.isatty() and sys.stdout.isatty():
        confirm = lambda: console.input("Build this environment? [Y/n] ").strip().lower() in ("", "y", "yes")  # noqa: E731
    options = manager.Options(request=request, root=root, use_pip=args.pip, force=args.force,
                              modify_path=not args.no_modify_path, upgrade=args.upgrade)
    return manager.install(options, plan, platform, console, confirm)


def _torch_index_url(args: argparse.Namespace) -> str | None:
    return args.torch_index_url or os.environ.get("UNSLOTH_TORCH_INDEX_URL") or None


def _package_sources(args: argparse.Namespace):
    """(Sources, where they came from): pip's configuration unless ignored, with the flags on top."""
    from unsloth.envs import manager
    from unsloth.envs.sources import Sources, with_overrides

    base = Sources() if args.ignore_pip_config else manager.pip_config_sources(args.python)
    sources = with_overrides(base, index_url=args.index_url, extra_index_urls=args.extra_index_url,
                             find_links=args.find_links)
    said = [name for name, given in (("--index-url", args.index_url), ("--extra-index-url", args.extra_index_url),
                                     ("--find-links", args.find_links)) if given]
    origin = ["your pip configuration"] if base != Sources() else []
    origin += [" ".join(said)] if said else []
    if not origin:
        origin = ["pip's configuration ignored" if args.ignore_pip_config else "no pip configuration: the default"]
    return sources, " + ".join(origin)


def _install_sources(args: argparse.Namespace, plan):
    """Where the real install would take each part from on this machine (what the build steps will use)."""
    from unsloth.envs import manager
    from unsloth.envs.sources import install_sources, local_listings

    sources, origin = _package_sources(args)
    return install_sources(plan, sources, origin, manager.python_tag(args.python), local_listings(sources.find_links),
                           _torch_index_url(args), tuple(args.without))


def run_rollback(args: argparse.Namespace) -> r.RolledBack | r.NothingToRollBack:
    from unsloth.envs import manager
    from unsloth.envs.paths import home

    return manager.rollback(home(), render.progress_console())


def run_uninstall(args: argparse.Namespace) -> r.Uninstalled | r.Declined:
    from rich.markup import escape

    from unsloth.envs import manager
    from unsloth.envs.paths import bin_dir, home

    console = render.progress_console()
    root = home()
    if not args.yes and sys.stdin.isatty():
        what = root if args.purge else f"{root}/envs, the launcher in {bin_dir()} and the PATH line"
        if console.input(escape(f"Remove {what}? [y/N] ")).strip().lower() not in ("y", "yes"):  # not markup
            return r.Declined()
    return manager.uninstall(root, console, purge=args.purge)
