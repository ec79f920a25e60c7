"""Two and three `sh install.sh --yes` started at the same moment from a fresh HOME: one builds, the
others wait on the install lock (the bootstrap environment is never rewritten under a running
install), then find everything in place; all exit 0 and one environment exists."""

from __future__ import annotations

import subprocess

import pytest

from installers_sandbox import Sandbox, copy_source, sandbox_env

pytestmark = [pytest.mark.slow, pytest.mark.network]

WITHOUT = ["--without", "llama-cpp"]  # a source build of llama.cpp takes minutes; its steps are tested elsewhere


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return copy_source(tmp_path_factory.mktemp("concurrent") / "src")


@pytest.mark.parametrize("runs", [2, 3])
def test_concurrent_installs_end_with_one_environment(source, tmp_path_factory, runs):
    home = tmp_path_factory.mktemp(f"home{runs}")
    box = Sandbox(home=home, source=source, env=sandbox_env(home, tmp_path_factory.getbasetemp()))
    procs = [subprocess.Popen(["sh", str(source / "install.sh"), "--yes", *WITHOUT], env=box.env, cwd=home,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(runs)]
    done = [(proc, *proc.communicate(timeout=1800)) for proc in procs]
    for proc, out, err in done:
        assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert len(box.envs()) == 1 and box.current() == box.envs()[0]
    built = [out for _, out, _ in done if "Ready" in out]
    assert len(built) == 1  # the others found it built
    waited = [err for _, _, err in done if "Another unsloth install is running" in err]
    assert len(waited) == runs - 1
    assert all("Up to date" in out for _, out, _ in done if out not in built)
    assert all("Traceback" not in out + err for _, out, err in done)
    doctor = box.run([str(box.launcher), "doctor"])
    assert doctor.returncode == 0, doctor.stdout[-3000:]
