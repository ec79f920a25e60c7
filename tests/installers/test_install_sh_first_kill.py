"""A first install.sh run stopped part-way, in a fresh HOME: a SIGTERM during the package step removes
the half-built environment; a SIGKILL there leaves it (and its step running in its own session) but
never as the current one; the next run ends that step, sweeps the folder, installs, and doctor is green.

The update path (an environment already there) is killed in test_install_sh_real.py; this is the run
with nothing to fall back on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from installers_sandbox import sandbox  # noqa: F401  (the module fixture)

from unsloth.envs.processes import PIDFILE

pytestmark = [pytest.mark.slow, pytest.mark.network]

WITHOUT = ["--without", "llama-cpp"]


def _start_install(sandbox) -> subprocess.Popen:
    # SIGINT reset to its default: under `./scripts/test &` the run would inherit it as ignored.
    return subprocess.Popen(["dash", str(sandbox.source / "install.sh"), "--yes", *WITHOUT], env=sandbox.env,
                            cwd=sandbox.home, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _wait_for_package_step(sandbox, run: subprocess.Popen, timeout: float = 900) -> Path:
    """The environment being built, once its package step runs (the marker the build writes)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name in sandbox.envs():
            logs = sandbox.unsloth_home / "envs" / name / "logs"
            if (logs / "03-packages.log").exists() and (logs / PIDFILE).exists():
                return sandbox.unsloth_home / "envs" / name
        if run.poll() is not None:
            raise AssertionError(f"install.sh ended (rc {run.returncode}) before its package step: {run.stdout.read()[-3000:]}")
        time.sleep(0.2)
    raise AssertionError("the first install never reached its package step")


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def test_a_stopped_first_install_removes_its_half_built_env(sandbox):
    run = _start_install(sandbox)
    half = _wait_for_package_step(sandbox, run)
    os.killpg(run.pid, signal.SIGTERM)
    out, _ = run.communicate(timeout=120)
    assert run.returncode != 0 and "half-built environment was removed" in out, out[-3000:]
    assert not half.exists() and sandbox.current() is None and sandbox.envs() == []


def test_a_killed_first_install_is_never_current_and_the_next_run_sweeps_it(sandbox):
    run = _start_install(sandbox)
    half = _wait_for_package_step(sandbox, run)
    step = int((half / "logs" / PIDFILE).read_text().split()[0])  # the running step's session
    os.killpg(run.pid, signal.SIGKILL)
    run.wait(timeout=60)
    assert half.exists() and sandbox.current() is None  # no chance to clean up, but nothing points at it
    again = sandbox.run(["dash", str(sandbox.source / "install.sh"), "--yes", *WITHOUT])
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"Removed unfinished builds left by an interrupted run: {half.name}" in again.stdout + again.stderr
    assert not half.exists() and sandbox.envs() == [sandbox.current()]
    assert not [p for p in psutil.process_iter() if _session(p.pid) == step]  # the orphaned step was ended
    doctor = sandbox.run([str(sandbox.launcher), "doctor"])
    assert doctor.returncode == 0, doctor.stdout[-3000:]
