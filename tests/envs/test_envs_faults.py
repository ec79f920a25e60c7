"""A build step killed at any point takes its whole process tree with it, or the next run ends it.

The step under test is a shell that starts a background writer (what uv's compiler is to uv) and
records its pid in a marker file: the tests wait for that marker, never for a time, and signal
with SIGTERM / SIGKILL, or SIGINT with its handler reset (a `&` job inherits SIGINT as ignored).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from rich.console import Console

from unsloth.envs import runner, state
from unsloth.envs.processes import PIDFILE
from unsloth.envs.runner import Step, run_step

# The step: a writer in the background that keeps touching the build folder, the shell waiting on it.
STEP = 'while :; do touch "$1/alive"; sleep 0.1; done & echo $! > "$1/writer.tmp"; mv "$1/writer.tmp" "$1/writer"; wait'

DRIVER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from rich.console import Console
    from unsloth.interrupts import signals_as_interrupt
    from unsloth.envs.runner import Step, run_step

    env = Path(sys.argv[1])
    try:
        with signals_as_interrupt():
            run_step(Step("llama-cpp", "llama.cpp", ["sh", "-c", sys.argv[2], "sh", str(env)]), env / "logs",
                     Console(file=sys.stderr), 4)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(130)
    """
)


def _reset_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(env: Path) -> tuple[subprocess.Popen, int]:
    env.mkdir(parents=True)
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(env), STEP], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, preexec_fn=_reset_sigint)
    deadline = time.monotonic() + 60
    while not (env / "writer").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the step never started its writer"
        time.sleep(0.05)
    return proc, int((env / "writer").read_text())


def _gone(pid: int, timeout: float = 10) -> bool:
    try:
        psutil.Process(pid).wait(timeout)
    except psutil.NoSuchProcess:
        return True
    except psutil.TimeoutExpired:
        return False
    return True


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_step_ends_its_whole_tree(tmp_path, how):
    env = tmp_path / "envs" / "half"
    proc, writer = _start(env)
    proc.send_signal(how)  # the unsloth process only, as `kill` or Ctrl-C on its pid
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in out
    assert _gone(writer), "the step's background child outlived it"
    assert not (env / "logs" / PIDFILE).exists()


def test_after_a_sigkill_the_next_sweep_ends_the_orphan_before_deleting(tmp_path):
    env = tmp_path / "envs" / "half"
    proc, writer = _start(env)
    proc.kill()
    proc.wait()
    assert psutil.pid_exists(writer)  # SIGKILL: unsloth could not end it ...
    assert (env / "logs" / PIDFILE).exists()
    assert state.sweep(tmp_path) == ["half"]  # ... so the next run, under the lock, does
    assert _gone(writer, timeout=0.5)
    assert not env.exists()


def test_a_sweep_leaves_a_reused_pid_alone(tmp_path):
    env = tmp_path / "envs" / "half"
    (env / "logs").mkdir(parents=True)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        # The recorded leader's pid is now a new session's leader, started at another time.
        (env / "logs" / PIDFILE).write_text(f"{bystander.pid} 12345.0\n")
        assert state.sweep(tmp_path) == ["half"]
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def test_a_long_step_reports_elapsed_time_and_its_last_line(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "PROGRESS_EVERY_S", 0.1)
    screen = tmp_path / "screen"
    code = "import time; print('[ 42%] Building C object ggml.c.o', flush=True); time.sleep(1.5)"
    with open(screen, "w") as handle:
        run_step(Step("llama-cpp", "llama.cpp from source", [sys.executable, "-c", code]), tmp_path / "logs",
                 Console(file=handle, width=200), 4)
    shown = screen.read_text()
    assert "… llama.cpp from source · 1s · [ 42%] Building C object ggml.c.o" in shown
    assert "✓ llama.cpp from source" in shown


@pytest.mark.slow  # a second pytest
def test_the_fault_tests_pass_when_the_suite_runs_in_the_background():
    """`./scripts/test &` starts the suite with SIGINT ignored, and every child inherits that: the
    kill tests still pass, because the work they interrupt resets it (or is stopped by SIGTERM)."""
    tests = [f"{__file__}::test_a_stopped_step_ends_its_whole_tree",
             f"{__file__}::test_after_a_sigkill_the_next_sweep_ends_the_orphan_before_deleting"]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                          cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=600,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert done.returncode == 0 and "3 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
