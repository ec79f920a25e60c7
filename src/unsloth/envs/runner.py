"""Run one install step: full output to a log file, its elapsed time and last line on screen, and
on failure the log's last lines, its path and the likely fix."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from unsloth.envs.processes import PIDFILE, group_options, kill_tree, record
from unsloth.errors import UnslothError


@dataclass
class Step:
    name: str  # short, used for the log file: "torch", "packages", "llama-cpp"
    title: str  # what the user reads: "PyTorch (cpu) from https://download.pytorch.org/whl/cpu"
    argv: list[str]
    env: dict[str, str | None] = field(default_factory=dict)  # on top of ours; None unsets a variable


class StepFailed(UnslothError):
    def __init__(self, step: Step, log: Path, tail: str, fix: str):
        super().__init__(f"{step.title} failed", fix)
        self.step, self.log, self.tail = step, log, tail


_CREDENTIALS = re.compile(r"(?<=://)[^/@\s:]+:[^/@\s]+@")


def redact(text: str) -> str:
    """Hide user:password in index URLs before anything is logged or shown."""
    return _CREDENTIALS.sub("***@", text)


# (pattern in the output, what to do about it): first match wins.
_FIXES = (
    # a full disk, a quota or a file-size limit, as the OS and uv's Rust errors say it
    (r"No space left on device|File too large|Disk quota exceeded|os error (28|27|122)",
     "Free some disk space (the log says where), then run the same command again."),
    (
        r"timed out|Timeout was reached|operation timed out|ReadTimeout",
        "A download stopped answering and was given up after {timeout}. Check the network or proxy, or allow "
        "longer (pip's `timeout` setting or `PIP_DEFAULT_TIMEOUT`, which uv gets too); behind a mirror set "
        "UNSLOTH_INDEX_URL; offline, pass --find-links <wheelhouse>.",
    ),
    (
        r"dns error|Name or service not known|Could not resolve|Connection refused|timed out|Failed to fetch|"
        r"Network is unreachable|ConnectError",
        "A package index could not be reached. Check the network or proxy; behind a mirror set "
        "UNSLOTH_INDEX_URL (and UNSLOTH_TORCH_INDEX_URL for PyTorch); offline, pass --find-links <wheelhouse>.",
    ),
    (
        r"No solution found|Could not find a version|ResolutionImpossible|not found in the package registry|"
        r"no matching distribution|was not found in",
        "No release fits the plan from the configured indexes. See the plan with `unsloth install --dry-run` "
        "and the indexes in the log's first line; a mirror may lack the version (UNSLOTH_INDEX_URL).",
    ),
    (
        r"CMake|cmake|CMAKE_|compiler|ninja|gcc|cl\.exe",
        "Building llama-cpp-python from source needs a C/C++ compiler and cmake (Debian/Ubuntu: "
        "`sudo apt install build-essential cmake`). Or leave it out: `unsloth install --without llama-cpp`.",
    ),
    (r"Permission denied|Access is denied", "A file could not be written: check that UNSLOTH_HOME is yours and writable."),
)


def likely_fix(output: str, timeout: str | None = None) -> str:
    """``timeout``: the network timeout the step ran with (seconds), when one was configured."""
    waited = f"{timeout} s" if timeout else "uv's or pip's default network timeout (30 s for uv, 15 s for pip)"
    for pattern, fix in _FIXES:
        if re.search(pattern, output):
            return fix.format(timeout=waited)
    return "Read the log for the first error; `unsloth install` again retries from a clean state."


PROGRESS_EVERY_S = 5.0  # how often a running step says how long it has run and what it last printed


def clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def run_step(step: Step, log_dir: Path, console: Console, index: int) -> str:
    """Run ``step``; return its output. Raises StepFailed (non-zero exit) or KeyboardInterrupt.

    While it runs, the screen shows its elapsed time and last output line (a terminal: live; a log
    or pipe: one line every PROGRESS_EVERY_S). Its process tree lives in a group of its own, which
    an interrupt ends whole, and is recorded in ``log_dir``/running.pid for a run after a SIGKILL.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{index:02d}-{step.name}.log"
    pidfile = log_dir / PIDFILE
    tail: deque[str] = deque(maxlen=25)
    lines: list[str] = []
    started = time.monotonic()
    with open(log, "w", encoding="utf-8") as handle, console.status(escape(step.title)) as status:
        handle.write("$ " + redact(" ".join(step.argv)) + "\n")
        for key, value in sorted(step.env.items()):
            handle.write(f"# {key}={redact(value) if value is not None else '(unset)'}\n")
        handle.flush()
        proc = subprocess.Popen(
            step.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={key: value for key, value in {**os.environ, **step.env}.items() if value is not None},
            text=True,
            encoding="utf-8",
            errors="replace",
            **group_options(),
        )
        reader = threading.Thread(target=_pump, args=(proc, handle, tail, lines), daemon=True)
        try:
            record(pidfile, proc)
            reader.start()
            next_report = started + PROGRESS_EVERY_S
            while True:
                try:
                    code = proc.wait(timeout=min(1.0, PROGRESS_EVERY_S))
                    break
                except subprocess.TimeoutExpired:
                    pass
                now = time.monotonic()
                last = tail[-1][-120:] if tail else ""
                progress = f"{step.title} · {clock(now - started)}" + (f" · {last}" if last else "")
                status.update(escape(progress))
                if not console.is_terminal and now >= next_report:
                    console.print(escape(f"  … {progress}"))
                    next_report = now + PROGRESS_EVERY_S
            reader.join()
        except BaseException:  # Ctrl-C or a signal: never leave the step, or anything it started, running
            kill_tree(proc)
            if reader.is_alive():
                reader.join(timeout=5)  # the pipe closes with the tree
            raise
        finally:
            pidfile.unlink(missing_ok=True)
    output = "".join(lines)
    if code != 0 and code == -getattr(signal, "SIGXFSZ", 0):
        # the OS ended the step for writing past the file-size limit (subprocess gives children the
        # signal's default action): it said nothing, so the cause is named here
        raise StepFailed(step, log, "\n".join(tail), "A file could not be written in full: a file-size limit "
                         "(`ulimit -f`) or a full disk stopped it. Free some disk space or raise the limit, then "
                         "run the same command again.")
    if code != 0:
        raise StepFailed(step, log, "\n".join(tail), likely_fix(output, step.env.get("UV_HTTP_TIMEOUT")))
    console.print(f"[green]✓[/] {escape(step.title)} [dim]({clock(time.monotonic() - started)})[/]")
    return output


def _pump(proc: subprocess.Popen, handle, tail: deque[str], lines: list[str]) -> None:
    """Copy the step's output to its log (credentials hidden) as it comes."""
    assert proc.stdout is not None
    for line in proc.stdout:
        handle.write(redact(line))
        handle.flush()
        tail.append(redact(line.rstrip()))
        lines.append(line)
