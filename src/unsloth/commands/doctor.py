"""`unsloth doctor`: check this machine and the managed environment, with the exact fix for each problem."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from unsloth.commands.detect import add_from_argument, detect_platform
from unsloth.commands.results import DoctorReport
from unsloth.errors import UsageError
from unsloth.selftest.run import DEFAULT_TIMEOUT_S


def _seconds(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text}: give a number of seconds above 0")
    return value


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "doctor", help="check the GPU, drivers and environment; print a fix for each problem",
        description="Check the GPU, drivers, device access, disk and the managed environment. "
        "Exit status 1 when a required check fails, 0 otherwise (warnings allowed), 2 for bad arguments.")
    parser.add_argument("--json", action="store_true",
                        help="print the report as JSON: findings, platform, plan, summary, timings (docs/doctor.md)")
    parser.add_argument("-v", "--verbose", action="store_true", help="show the machine and each check's evidence")
    add_from_argument(parser)
    parser.add_argument("--dump", type=Path, metavar="DIR",
                        help="also write every probe's raw output into DIR, to attach to a bug report")
    parser.add_argument("--python", type=Path, metavar="PATH",
                        help="run the environment checks with this interpreter (e.g. .venv/bin/python) "
                        "instead of the managed environment's")
    parser.add_argument("--quick", action="store_true",
                        help="skip the environment checks, the slow part (they start the environment's Python)")
    parser.add_argument("--timeout", type=_seconds, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                        help=f"give the environment checks this long before calling them hung (default {DEFAULT_TIMEOUT_S})")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> DoctorReport:
    from unsloth.doctor.run import diagnose
    from unsloth.platform.dump import write_dump, write_reports

    if args.from_dir is not None and (args.dump is not None or args.python is not None):
        raise UsageError("--from reads another machine's dump; --dump and --python need this machine",
                         "drop --from to check this machine, or drop --dump / --python")
    start = time.monotonic()
    platform, results = detect_platform(args.from_dir)
    timings = {"detect": time.monotonic() - start}
    if args.dump is not None:
        try:
            write_dump(args.dump, results)
        except OSError as exc:  # a file in the way, a read-only place: say where, before any checking
            raise _unwritable(args.dump, exc) from exc
    report = diagnose(platform, source=str(args.from_dir) if args.from_dir else "live", python=args.python,
                      env_checks=not args.quick, timeout_s=args.timeout, timings=timings)
    if args.dump is not None:
        try:
            write_reports(args.dump, {"detect": platform.to_json(),
                                      "plan": report.plan.to_json() if report.plan is not None else None})
        except OSError as exc:
            raise _unwritable(args.dump, exc) from exc
    return DoctorReport(report, platform, verbose=args.verbose, from_dir=args.from_dir, dump=args.dump)


def _unwritable(dump: Path, exc: OSError) -> UsageError:
    return UsageError(f"--dump {dump}: cannot write the dump there ({exc.strerror or exc})", "pick another folder")
