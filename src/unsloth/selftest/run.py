"""Run the self-test script in an environment's own Python: the one side effect of the self-test.

It runs from a fresh folder (a copy of the script), so nothing in the current directory (a project's
own `torch/` or `kernels/`) shadows the environment's packages, and a hang is ended at a timeout with
everything it started.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from unsloth.selftest import script
from unsloth.selftest.parse import parse_probe_output

DEFAULT_TIMEOUT_S = 180  # torch + bitsandbytes imports and a first Triton compile; a hang is far longer


@dataclass
class ProbeRun:
    """What one run of the script said (its lines by check), and how it ended."""

    results: dict[str, dict[str, Any]] = field(default_factory=dict)  # check name -> the probe's line
    timed_out: bool = False
    returncode: int | None = None
    stderr: str = ""
    seconds: float = 0.0
    timeout_s: float = DEFAULT_TIMEOUT_S


def copy_script(folder: Path) -> Path:
    """The script, copied into ``folder``: run from there, its own folder (the first entry of its
    ``sys.path``) holds nothing that could shadow a package."""
    copy = folder / "selftest.py"
    shutil.copyfile(script.__file__, copy)
    return copy


def run_env_probe(python: Path, plan_backend: str, timeout_s: float = DEFAULT_TIMEOUT_S,
                  plan_env: Mapping[str, str] | None = None, with_checks: tuple[str, ...] = ()) -> ProbeRun:
    """Run selftest.py with ``python``, under the plan's env vars (``plan.env``: an
    HSA_OVERRIDE_GFX_VERSION some GPUs need), as training will run. It runs from a fresh folder so
    nothing in the current directory (a project's own `torch/` or `kernels/`) shadows the
    environment's packages. ``with_checks``: the opt-in parts the environment holds (vLLM), checked too."""
    with tempfile.TemporaryDirectory(prefix="unsloth-selftest-") as tmp:
        copy = copy_script(Path(tmp))
        env = {**os.environ, **(plan_env or {}), "PYTHONNOUSERSITE": "1", "PYTHONDONTWRITEBYTECODE": "1"}
        env.pop("PYTHONPATH", None)  # the environment's own packages, not ours
        start = time.monotonic()
        try:
            # Its own session, so a hang is ended with everything it started (compilers, workers).
            argv = [str(python), str(copy), "--backend", plan_backend, *(f"--with={name}" for name in with_checks)]
            process = subprocess.Popen(argv, cwd=tmp, env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       start_new_session=os.name == "posix")
        except OSError as exc:  # the interpreter is missing or not executable
            return ProbeRun(stderr=str(exc), timeout_s=timeout_s)
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            _kill(process)
            try:
                stdout, stderr = process.communicate(timeout=10)
            except subprocess.TimeoutExpired:  # a grandchild still holds the pipes (Windows kills only the child)
                stdout, stderr = "", ""
            timed_out = True
        seconds = time.monotonic() - start
    return ProbeRun(parse_probe_output(stdout), timed_out, None if timed_out else process.returncode, stderr,
                    seconds, timeout_s)


def _kill(process: subprocess.Popen) -> None:
    if os.name == "posix":
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    else:
        process.kill()
