"""install.sh for real, in a sandboxed HOME: a CPU install using this machine's pip configuration,
then re-runs, a concurrent run, a killed update, rollback, a lock export and uninstall.

The tests share one install (module fixture) and run in file order, like a user's week.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from installers_sandbox import sandbox  # noqa: F401  (the module fixture)

from unsloth.envs.lock import InstallLock
from unsloth.envs.paths import LOCK_NAME
from unsloth.envs.processes import PIDFILE

pytestmark = [pytest.mark.slow, pytest.mark.network]

WITHOUT = ["--without", "llama-cpp"]  # a source build of llama.cpp takes minutes; tested through its plan step elsewhere


@pytest.fixture(scope="module")
def installed(sandbox):
    before = sandbox.files()
    done = sandbox.run(["dash", str(sandbox.source / "install.sh"), "--yes", *WITHOUT])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return before, done


def receipt(sandbox, name=None) -> dict:
    name = name or sandbox.current()
    return json.loads((sandbox.unsloth_home / "envs" / name / "receipt.json").read_text())


def test_fresh_home_ends_with_unsloth_on_path_and_a_green_doctor(sandbox, installed):
    _, done = installed
    assert "Ready" in done.stdout and "unsloth doctor" in done.stdout
    assert "Done. Run:" in done.stderr  # install.sh got past `unsloth doctor` (exit 0 = no required check failed)
    # PATH: one line in the start-up files, the user's own content untouched.
    bashrc = (sandbox.home / ".bashrc").read_text()
    assert bashrc.startswith("# the user's own settings\nexport EDITOR=vi\n") and bashrc.count("unsloth installer") == 1
    shell = subprocess.run(["bash", "-c", ". ~/.bashrc; command -v unsloth"], env=sandbox.env, capture_output=True, text=True)
    assert shell.stdout.strip() == str(sandbox.launcher)
    doctor = sandbox.run([str(sandbox.launcher), "doctor", "--json"])
    report = json.loads(doctor.stdout)
    assert doctor.returncode == 0 and report["summary"]["failed_required"] == []
    assert {f["id"]: f["status"] for f in report["findings"]}["env-torch"] == "ok"


def test_the_receipt_says_what_was_installed_and_from_where(sandbox, installed):
    data = receipt(sandbox)
    assert data["schema"] == 1 and data["plan"]["torch"]["backend"] == "cpu"
    assert data["packages"]["torch"].endswith("+cpu") and data["verified"]["cuda"] is None
    assert data["unsloth"]["source"] == str(sandbox.source)
    assert data["installer"]["tool"] == "uv" and data["without"] == ["llama-cpp"]
    torch_from = data["indexes"]["torch"]
    if torch_from["mode"] == "wheelhouse":  # this machine's pip configuration names a wheelhouse with the CPU build
        wheel = f"torch-{data['packages']['torch']}-"
        assert any(name.startswith(wheel) for name in os.listdir(torch_from["url"]))
    else:
        assert torch_from["url"] == data["plan"]["torch"]["index_url"]
    assert all(data["verified"]["imports"][m] == "ok" for m in ("unsloth", "transformers", "peft", "trl"))
    log_names = sorted(p.name for p in (sandbox.unsloth_home / "envs" / data["name"] / "logs").iterdir())
    assert log_names[:3] == ["01-venv.log", "02-torch.log", "03-packages.log"]


def test_second_run_under_bash_is_a_fast_no_op(sandbox, installed):
    active = sandbox.current()
    start = time.monotonic()
    done = sandbox.run(["bash", str(sandbox.source / "install.sh"), "--yes", *WITHOUT])
    elapsed = time.monotonic() - start
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Up to date" in done.stdout and "Nothing changed" in done.stderr
    assert sandbox.current() == active and sandbox.envs() == [active]
    assert elapsed < 60, f"a no-op re-run took {elapsed:.0f}s"
    assert (sandbox.home / ".bashrc").read_text().count("unsloth installer") == 1


def test_a_concurrent_run_waits_for_the_lock(sandbox, installed):
    active = sandbox.current()
    with InstallLock(sandbox.unsloth_home / LOCK_NAME):
        other = subprocess.Popen([str(sandbox.launcher), "install", "--yes", *WITHOUT], env=sandbox.env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        first = other.stdout.readline() + other.stdout.readline()
        deadline = time.monotonic() + 60
        while "waiting" not in first and time.monotonic() < deadline:
            first += other.stdout.readline()
        assert "Another unsloth install is running" in first
        time.sleep(1)
        assert other.poll() is None and sandbox.envs() == [active]  # it waits, touching nothing
    rest, _ = other.communicate(timeout=300)
    assert other.returncode == 0 and "Up to date" in rest


def _start_forced_build(sandbox) -> subprocess.Popen:
    # SIGINT reset to its default: under `./scripts/test &` the build would inherit it as ignored.
    return subprocess.Popen([str(sandbox.launcher), "install", "--force", "--yes", *WITHOUT], env=sandbox.env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _wait_for_new_build(sandbox, active: str, timeout: float = 120) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name in sandbox.envs():
            logs = sandbox.unsloth_home / "envs" / name / "logs"
            if name != active and (logs / "03-packages.log").exists() and (logs / PIDFILE).exists():
                return sandbox.unsloth_home / "envs" / name
        time.sleep(0.2)
    raise AssertionError("the forced build never reached its package step")


def _previous_env_still_works(sandbox, active: str) -> None:
    assert sandbox.current() == active
    torch = sandbox.run([str(sandbox.launcher), "env", "path", "--python"])
    version = sandbox.run([torch.stdout.strip(), "-c", "import torch; print(torch.__version__)"])
    assert version.returncode == 0 and version.stdout.strip() == receipt(sandbox)["packages"]["torch"]
    doctor = sandbox.run([str(sandbox.launcher), "doctor"])  # green, as before the kill
    assert doctor.returncode == 0, doctor.stdout[-3000:]


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_update_removes_its_half_built_env(sandbox, installed, how):
    active = sandbox.current()
    build = _start_forced_build(sandbox)
    half = _wait_for_new_build(sandbox, active)
    os.killpg(build.pid, how)
    out, _ = build.communicate(timeout=120)
    assert build.returncode != 0 and "half-built environment was removed" in out
    assert not half.exists() and sandbox.envs() == [active]
    _previous_env_still_works(sandbox, active)


def test_a_killed_update_leaves_the_previous_env_working_and_is_swept_later(sandbox, installed):
    active = sandbox.current()
    build = _start_forced_build(sandbox)
    half = _wait_for_new_build(sandbox, active)
    step = int((half / "logs" / PIDFILE).read_text().split()[0])  # the running step's session
    os.killpg(build.pid, signal.SIGKILL)
    build.wait(timeout=60)
    assert half.exists()  # SIGKILL: no chance to clean up, and the step runs on in its own session ...
    _previous_env_still_works(sandbox, active)
    listing = sandbox.run([str(sandbox.launcher), "env", "list"])
    assert f"{half.name}  unfinished" in listing.stdout
    again = sandbox.run([str(sandbox.launcher), "install", "--yes", *WITHOUT])
    assert again.returncode == 0 and f"Removed unfinished builds left by an interrupted run: {half.name}" in again.stdout
    assert not half.exists() and sandbox.envs() == [active]  # ... so the next run ends it and sweeps
    assert not [p for p in psutil.process_iter() if _session(p.pid) == step]


def _file_size_limit(limit: int = 20 << 20):
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def test_an_update_that_runs_out_of_disk_keeps_the_previous_env(sandbox, installed):
    """A file-size limit stands in for a full disk: the package step cannot write torch's libraries.
    One message with the fix, no traceback, the half-built environment gone, the previous one current."""
    active = sandbox.current()
    env = {**sandbox.env, "UV_LINK_MODE": "copy"}  # copied out of uv's cache, not hard-linked: real writes
    done = subprocess.run([str(sandbox.launcher), "install", "--force", "--yes", *WITHOUT], env=env, cwd=sandbox.home,
                          capture_output=True, text=True, timeout=900, preexec_fn=_file_size_limit)
    out = done.stdout + done.stderr
    assert done.returncode != 0 and "Traceback" not in out, out[-3000:]
    assert "Free some disk space" in out and "still the active environment" in out, out[-3000:]
    assert sandbox.envs() == [active]
    _previous_env_still_works(sandbox, active)


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def test_env_export_reproduces_the_environment_exactly(sandbox, installed, tmp_path):
    lock = tmp_path / "unsloth.lock.txt"
    done = sandbox.run([str(sandbox.launcher), "env", "export", "-o", str(lock)])
    assert done.returncode == 0, done.stderr
    text = lock.read_text()
    packages = receipt(sandbox)["packages"]
    assert f"torch=={packages['torch']}" in text.splitlines()
    assert f"unsloth-installer @ {sandbox.source.as_uri()}" in text.splitlines()
    options = [line for line in text.splitlines() if line.startswith("--")]
    assert len(options) == len(set(options))  # each index or wheelhouse once
    uv = str(sandbox.unsloth_home / "bootstrap" / "bin" / "uv")
    copy = tmp_path / "copy"
    python = sandbox.run([str(sandbox.launcher), "env", "path", "--python"]).stdout.strip()
    made = sandbox.run([uv, "venv", "-q", "--python", python, str(copy)])
    assert made.returncode == 0, made.stderr
    built = sandbox.run([uv, "pip", "install", "-q", "--python", str(copy / "bin" / "python"),
                         "--index-strategy", "unsafe-best-match", "-r", str(lock)])
    assert built.returncode == 0, built.stderr[-3000:]
    frozen = sandbox.run([str(copy / "bin" / "python"), "-c",
                          "import importlib.metadata as m, json; print(json.dumps({d.metadata['Name'].lower(): d.version for d in m.distributions()}))"])
    assert json.loads(frozen.stdout) == packages


def test_a_forced_rebuild_then_rollback_and_back(sandbox, installed):
    first = sandbox.current()
    done = sandbox.run([str(sandbox.launcher), "install", "--force", "--yes", *WITHOUT])
    assert done.returncode == 0, done.stdout[-3000:]
    second = sandbox.current()
    assert second != first and sandbox.envs() == sorted([first, second])
    back = sandbox.run([str(sandbox.launcher), "rollback"])
    assert back.returncode == 0 and sandbox.current() == first
    # the launcher now runs the first environment's own unsloth
    assert sandbox.run([str(sandbox.launcher), "env", "path"]).stdout.strip().endswith(first)
    forth = sandbox.run([str(sandbox.launcher), "rollback"])
    assert forth.returncode == 0 and sandbox.current() == second


def test_uninstall_leaves_nothing_behind(sandbox, installed):
    before, _ = installed
    hf_cache = sandbox.home / ".cache" / "huggingface" / "model.bin"  # user data: must stay
    hf_cache.parent.mkdir(parents=True, exist_ok=True)
    hf_cache.write_text("weights")
    done = sandbox.run([str(sandbox.launcher), "uninstall", "--yes"])
    assert done.returncode == 0, done.stdout + done.stderr
    assert sandbox.files() == before
    assert (sandbox.home / ".bashrc").read_text() == "# the user's own settings\nexport EDITOR=vi\n"
    assert hf_cache.read_text() == "weights"
