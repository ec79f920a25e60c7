"""A build step's process tree: started in its own group, ended with it, and reaped after a crash.

uv or pip start compilers (cmake, cc) of their own. Killing only the direct child would leave them
running, so every step gets a new session (POSIX) or process group (Windows) and an interrupt ends
the whole of it. A SIGKILL of unsloth itself cannot do that, so each running step is recorded in a
pid file inside its build folder; the next run, under the install lock, ends what is left of that
tree before it deletes the folder (otherwise the orphan re-creates what was swept).
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import psutil

PIDFILE = "running.pid"


def group_options() -> dict[str, Any]:
    """Popen arguments that give the child a process group of its own."""
    if os.name == "nt":
        return {"creationflags": subprocess.CREATE_NEW_PROCESS_GROUP}
    return {"start_new_session": True}


def kill_tree(proc: subprocess.Popen) -> None:
    """End ``proc`` and everything it started, then reap it."""
    if os.name == "nt":
        subprocess.run(["taskkill", "/F", "/T", "/PID", str(proc.pid)], capture_output=True)
    else:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the session leader's pid is its group id
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def record(pidfile: Path, proc: subprocess.Popen) -> None:
    """Write "pid start-time" of a step's leader, so a later run can tell it from a reused pid."""
    try:
        started = psutil.Process(proc.pid).create_time()
    except psutil.Error:
        started = 0.0
    pidfile.write_text(f"{proc.pid} {started!r}\n", encoding="utf-8")


def reap(pidfile: Path) -> list[int]:
    """End what is left of a recorded step's process tree; returns the pids signalled.

    Safe against pid reuse: a POSIX kernel hands out no pid still in use as a session id, so any
    process in session ``pid`` belongs to that step; the leader itself is only killed when its
    start time matches the record.
    """
    try:
        pid_text, started_text = pidfile.read_text(encoding="utf-8").split()
        pid, started = int(pid_text), float(started_text)
    except (OSError, ValueError):
        return []
    leader_is_ours = False
    try:
        leader_is_ours = abs(psutil.Process(pid).create_time() - started) < 1e-3
    except psutil.Error:
        pass
    if os.name == "nt":  # pragma: no cover - Windows: the tree below a living leader
        if not leader_is_ours:
            return []
        members = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    else:
        members = [p for p in psutil.process_iter() if _session(p.pid) == pid]
        if any(p.pid == pid for p in members) and not leader_is_ours:
            return []  # a new session leader took the pid: not ours
    killed = []
    for process in members:
        try:
            process.kill()
            killed.append(process.pid)
        except psutil.Error:
            pass
    psutil.wait_procs(members, timeout=10)
    return killed


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None
