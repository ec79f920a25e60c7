"""The install lock serializes processes; a failed step shows its tail, its log and the likely fix."""

import contextlib
import subprocess
import sys
import textwrap
import time

import pytest
from rich.console import Console

from unsloth.envs.lock import InstallLock
from unsloth.envs.runner import Step, StepFailed, likely_fix, redact, run_step

HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from unsloth.envs.lock import InstallLock
    with InstallLock(Path(sys.argv[1]), on_wait=lambda who: print("waiting for", who, flush=True)):
        print("got it", time.monotonic(), flush=True)
        time.sleep(float(sys.argv[2]))
        print("released", time.monotonic(), flush=True)
    """
)


def test_two_processes_never_hold_the_lock_together(tmp_path):
    lock = tmp_path / "install.lock"
    first = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock), "1.5"], stdout=subprocess.PIPE, text=True)
    assert first.stdout.readline().startswith("got it")
    second = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock), "0"], stdout=subprocess.PIPE, text=True)
    out_first, _ = first.communicate(timeout=30)
    out_second, _ = second.communicate(timeout=30)
    released = float(out_first.split()[-1])
    assert out_second.startswith(f"waiting for {first.pid}")
    got = float(out_second.splitlines()[1].split()[-1])
    assert got >= released


def test_the_lock_dies_with_its_holder(tmp_path):
    lock = tmp_path / "install.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock), "60"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().startswith("got it")
    holder.kill()
    holder.wait()
    start = time.monotonic()
    with InstallLock(lock):
        assert time.monotonic() - start < 5


def test_a_failed_step_keeps_its_full_log_and_shows_the_tail(tmp_path):
    script = "import sys\nfor i in range(100): print('line', i)\nprint('error: No solution found when resolving'); sys.exit(3)"
    step = Step("packages", "the packages", [sys.executable, "-c", script], env={"TOKEN_URL": "https://u:secret@idx/simple"})
    console = Console(file=open(tmp_path / "screen", "w"))
    with pytest.raises(StepFailed) as failed:
        run_step(step, tmp_path / "logs", console, 3)
    error = failed.value
    assert error.log == tmp_path / "logs" / "03-packages.log"
    log = error.log.read_text()
    assert "line 0\n" in log and "line 99\n" in log and "secret" not in log  # whole output, credentials hidden
    assert error.tail.splitlines()[-1] == "error: No solution found when resolving"
    assert len(error.tail.splitlines()) == 25
    assert "unsloth install --dry-run" in error.fix


def test_a_step_ended_by_the_file_size_limit_names_the_disk(tmp_path):
    # the step writes past `ulimit -f` with the signal's default action (as uv has it; Python itself
    # ignores SIGXFSZ): the OS ends it, and it says nothing
    script = ("import os, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_DFL); "
              "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096)); "
              "fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT); os.write(fd, bytes(8192)); os.write(fd, bytes(8192))")
    step = Step("torch", "PyTorch", [sys.executable, "-c", script, str(tmp_path / "big")], env={})
    console = Console(file=open(tmp_path / "screen", "w"))
    with pytest.raises(StepFailed) as failed:
        run_step(step, tmp_path / "logs", console, 2)
    assert "file-size limit" in failed.value.fix and "Free some disk space" in failed.value.fix


def test_a_good_step_returns_its_output_and_gets_exactly_its_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_FIND_LINKS", "/somewhere")
    console = Console(file=open(tmp_path / "screen", "w"))
    code = "import os; print(os.environ.get('PIP_FIND_LINKS'), os.environ['X'])"
    out = run_step(Step("ok", "ok", [sys.executable, "-c", code], env={"PIP_FIND_LINKS": None, "X": "1"}), tmp_path, console, 1)
    assert out == "None 1\n"
    assert "✓ ok" in (tmp_path / "screen").read_text()


@pytest.mark.parametrize(
    "output, words",
    [
        ("error: failed to lookup address information: Name or service not known", "could not be reached"),
        ("OSError: [Errno 28] No space left on device", "disk space"),
        ("error: Failed to install: torch-2.13.0 ... File too large (os error 27)", "disk space"),
        ("OSError: [Errno 122] Disk quota exceeded", "disk space"),
        ("CMake Error at CMakeLists.txt: could not find compiler", "--without llama-cpp"),
        ("something else entirely", "Read the log"),
    ],
)
def test_likely_fix_names_the_cause(output, words):
    assert words in likely_fix(output)


def test_a_dead_download_is_reported_with_the_timeout_it_ran_under(tmp_path):
    script = "import sys; print('error: Failed to fetch torch-2.13.0.whl: operation timed out'); sys.exit(2)"
    step = Step("torch", "PyTorch", [sys.executable, "-c", script], env={"UV_HTTP_TIMEOUT": "180"})
    with pytest.raises(StepFailed) as failed:
        run_step(step, tmp_path / "logs", Console(file=open(tmp_path / "screen", "w")), 2)
    assert "given up after 180 s" in failed.value.fix and "PIP_DEFAULT_TIMEOUT" in failed.value.fix
    assert "default network timeout (30 s for uv" in likely_fix("Read timed out.")


def test_redact_hides_index_credentials_only():
    assert redact("--index-url https://me:tok@corp.example/simple x") == "--index-url https://***@corp.example/simple x"
    assert redact("https://download.pytorch.org/whl/cpu") == "https://download.pytorch.org/whl/cpu"


def test_tool_output_that_looks_like_markup_is_shown_verbatim(tmp_path, monkeypatch):
    """pip prints "[notice] ..."; a path may read "[/usr/lib]": rich must not eat or choke on them."""
    from unsloth.commands import render
    from unsloth.envs import manager
    from unsloth.envs.steps import Request
    from unsloth.matrix import load_matrix
    from unsloth.plan import resolve
    from unsloth.platform.facts import Platform

    tail = "[notice] A new release of pip is available\nerror: [/usr/lib/x] is not writable"

    def failing_build(root, request, plan, platform, console, use_pip=False):
        raise StepFailed(Step("packages", "the [packages]", []), tmp_path / "01-packages.log", tail, "fix [/this]")

    monkeypatch.setattr(manager, "build", failing_build)
    platform = Platform(os="linux")
    screen = tmp_path / "screen"
    with open(screen, "w") as out, contextlib.redirect_stdout(out):
        options = manager.Options(request=Request(source=str(tmp_path)), root=tmp_path / "home")
        outcome = manager.install(options, resolve(platform, load_matrix()), platform, Console(file=out, width=200))
        code = render.show(outcome)
    assert code == 1
    text = screen.read_text()
    assert tail in text and "the [packages] failed" in text and "Likely fix: fix [/this]" in text


INSTALLER = textwrap.dedent(
    """
    import os, subprocess, sys
    from pathlib import Path
    from unsloth.envs.lock import OWNER_ENV, InstallLock
    # As install.sh does: hold the lock, name ourselves, start `unsloth install`.
    with InstallLock(Path(sys.argv[1])):
        child = "from pathlib import Path; import sys; from unsloth.envs.lock import InstallLock\\n" \\
                "with InstallLock(Path(sys.argv[1]), on_wait=lambda who: sys.exit('waited for ' + who)): print('inherited')"
        done = subprocess.run([sys.executable, "-c", child, sys.argv[1]], env={**os.environ, OWNER_ENV: str(os.getpid())},
                              capture_output=True, text=True, timeout=60)
        print(done.stdout.strip() or done.stderr.strip(), flush=True)
        print("holding", flush=True)
        sys.stdin.readline()
    """
)


def test_the_installer_scripts_lock_is_inherited_by_the_install_it_starts_and_nobody_else(tmp_path, monkeypatch):
    lock = tmp_path / "install.lock"
    holder = subprocess.Popen([sys.executable, "-c", INSTALLER, str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "inherited"  # its own child: no wait
        assert holder.stdout.readline().strip() == "holding"
        monkeypatch.setenv("UNSLOTH_LOCK_OWNER", str(holder.pid))  # the name alone gives nothing to a stranger

        class Waited(Exception):
            pass

        def waited(who):
            raise Waited(who)

        with pytest.raises(Waited):
            with InstallLock(lock, on_wait=waited):
                pass
    finally:
        holder.communicate("\n", timeout=30)
    assert holder.returncode == 0
    with InstallLock(lock):  # free once the installer ends: the inheriting child kept nothing
        pass


def test_a_disk_too_small_for_the_environment_is_refused_before_building(tmp_path, monkeypatch, capsys):
    """Estimated before anything is written (the plan's backend), through the real entry point."""
    import shutil
    from collections import namedtuple

    from unsloth.cli import main
    from unsloth.envs import manager
    from unsloth.envs.paths import ENV_DISK_GIB

    usage = namedtuple("usage", "total used free")
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 * 2**30, 9 * 2**30, 2**30) if
                        str(path).startswith(str(tmp_path)) else real(path))
    monkeypatch.setattr(manager, "build", lambda *a, **k: pytest.fail("built on a disk without room"))
    monkeypatch.setenv("UNSLOTH_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("UNSLOTH_BIN_DIR", str(tmp_path / "bin"))
    (tmp_path / "src").mkdir()
    code = main(["install", "--yes", "--source", str(tmp_path / "src"), "--ignore-pip-config", "--no-modify-path"])
    out, err = capsys.readouterr()
    assert code == 1 and "Traceback" not in out + err
    need = ENV_DISK_GIB["cpu"]
    assert (f"not enough free disk for a cpu environment: 1.0 GiB free in {tmp_path / 'home'}, it needs about {need} GiB; "
            "nothing was installed") in err
    assert "fix: free some space there, or set UNSLOTH_HOME" in err
    assert not (tmp_path / "home" / "envs").exists() and not (tmp_path / "bin").exists()
