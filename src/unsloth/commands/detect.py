"""`unsloth detect`: what this machine (or a dump) has, and which probe said so."""

from __future__ import annotations

import argparse
from pathlib import Path

from unsloth.commands.results import PlatformReport
from unsloth.errors import UsageError


def add_from_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from", dest="from_dir", type=Path, metavar="DIR",
                        help="read a dump (written by `unsloth doctor --dump DIR`) instead of probing this machine")


def detect_platform(from_dir: Path | None):
    """(Platform, probe results) from the live machine or a dump; a UsageError when the dump cannot be read."""
    from unsloth.platform.detect import detect_from_dump, detect_live

    if from_dir is None:
        return detect_live()
    fix = "pass the folder `unsloth doctor --dump DIR` wrote (it holds <probe>.txt files and probes.json)"
    try:
        platform, results = detect_from_dump(from_dir)
    except OSError as exc:  # read_dump: not a directory, unreadable file
        problem = f"--from {from_dir}: cannot read the dump ({exc.strerror})" if exc.strerror else str(exc)
        raise UsageError(problem, fix) from exc
    if not results:  # an empty or wrong folder would otherwise read as "a machine with nothing"
        raise UsageError(f"--from {from_dir}: no probe outputs here", fix)
    return platform, results


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "detect", help="show the OS, drivers and GPUs unsloth sees",
        description="Show the OS, drivers, ROCm/CUDA and every GPU, with the probe each fact came from.")
    parser.add_argument("--json", action="store_true", help="print the Platform as JSON")
    add_from_argument(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> PlatformReport:
    platform, _ = detect_platform(args.from_dir)
    return PlatformReport(platform)
