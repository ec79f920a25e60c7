"""`unsloth detect` and `unsloth doctor` through the real entry points, on fixture dumps, on dumps
written here, and on this machine (no GPU; CPU torch in this .venv)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from unsloth.cli import main
from unsloth.envs.receipt import Receipt, write_receipt

DUMPS = Path(__file__).parents[1] / "fixtures" / "dumps"
WSL_4090 = DUMPS / "nvidia-smi__rtx4090_wsl__1"
WINDOWS_AMD = DUMPS / "Get-WmiObject__gfx1036+gfx1100_windows__1"
NAVI31_LSPCI = DUMPS / "lspci__navi31__1"
LIVE_ONLY = "checked only on the live machine, not on a dump"


@pytest.fixture(autouse=True)
def empty_home(tmp_path, monkeypatch):
    """No managed environment unless a test makes one: UNSLOTH_HOME points at an empty folder."""
    home = tmp_path / "unsloth-home"
    monkeypatch.setenv("UNSLOTH_HOME", str(home))
    monkeypatch.delenv("HSA_OVERRIDE_GFX_VERSION", raising=False)
    return home


def run_json(capsys, *argv: str) -> tuple[int, dict, str]:
    """Exit code, the JSON on stdout, and stderr."""
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, json.loads(captured.out), captured.err


def findings(report: dict) -> dict[str, dict]:
    return {finding["id"]: finding for finding in report["findings"]}


# --- detect ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dump", [WSL_4090, WINDOWS_AMD, NAVI31_LSPCI], ids=lambda p: p.name)
def test_detect_json_on_fixture_dumps_matches_their_expectations(capsys, dump):
    expect = json.loads((dump / "expect.json").read_text())["detect"]
    code, platform, _ = run_json(capsys, "detect", "--json", "--from", str(dump))
    assert code == 0
    for key in ("os", "wsl", "nvidia_driver", "cuda_driver"):
        if key in expect:
            assert platform[key] == expect[key], key
    for want, gpu in zip(expect["gpus"], platform["gpus"]):
        for key in ("vendor", "arch", "family", "integrated", "pci_id"):
            if key in want:
                assert gpu[key] == want[key], key


def test_detect_table_names_each_gpu_and_the_probe_that_saw_it(capsys):
    assert main(["detect", "--from", str(WINDOWS_AMD)]) == 0
    out = capsys.readouterr().out
    assert "gfx1100" in out and "gfx1036" in out and "RDNA3" in out and "win32-videocontroller" in out
    assert "1002:744c" in out


def test_detect_json_on_this_machine(capsys):
    code, platform, _ = run_json(capsys, "detect", "--json")
    assert code == 0
    assert platform["os"] == {"linux": "linux", "win32": "windows", "darwin": "macos"}[sys.platform]
    assert platform["probes"] and all(status in ("ok", "absent", "failed", "timeout")
                                      for status in platform["probes"].values())


def test_detect_on_a_missing_dump_is_a_usage_error(capsys, tmp_path):
    assert main(["detect", "--from", str(tmp_path / "nope")]) == 2
    assert "unsloth doctor --dump" in capsys.readouterr().err


# --- doctor on dumps --------------------------------------------------------------------------------

def test_doctor_json_on_a_wsl_dump(capsys):
    code, report, _ = run_json(capsys, "doctor", "--json", "--from", str(WSL_4090))
    assert code == 0
    assert set(report) >= {"schema", "source", "findings", "platform", "plan", "summary"}
    assert report["platform"]["wsl"] is True and report["plan"]["torch"]["backend"] == "cuda"
    found = findings(report)
    assert found["gpu"]["status"] == "ok" and "RTX 4090" in found["gpu"]["message"]
    assert found["driver"]["status"] == "ok" and "531.29" in found["driver"]["message"]
    # Live-only checks say why they did not run; the environment is never this machine's.
    for check in ("wsl-bridge", "disk", "env", "env-torch", "env-matmul"):
        assert (found[check]["status"], found[check]["message"]) == ("skipped", LIVE_ONLY)
    summary = report["summary"]
    assert sum(summary[s] for s in ("ok", "warning", "error", "skipped")) == len(report["findings"])
    assert (summary["exit_code"], summary["failed_required"]) == (0, [])


@pytest.mark.parametrize("dump", sorted(p for p in DUMPS.iterdir() if p.is_dir()), ids=lambda p: p.name)
def test_doctor_reads_every_fixture_dump(capsys, dump):
    """Whatever a dump holds (one tool's output, Windows encodings), doctor reports on it."""
    code, report, _ = run_json(capsys, "doctor", "--json", "--from", str(dump))
    assert code == report["summary"]["exit_code"] in (0, 1)
    assert {f["status"] for f in report["findings"]} <= {"ok", "warning", "error", "skipped"}
    assert all(f["message"] and "\n" not in f["message"] for f in report["findings"])  # one line each
    assert all(f["fix"] for f in report["findings"] if f["status"] == "error")


def test_doctor_on_a_dump_taken_on_windows(capsys):
    code, report, _ = run_json(capsys, "doctor", "--json", "--from", str(WINDOWS_AMD))
    assert code == 0 and report["platform"]["os"] == "windows"
    found = findings(report)
    assert "runtime" not in found  # AMD's Windows wheels carry their own ROCm
    assert "dev-kfd" not in found and "wsl-bridge" not in found


def test_a_required_failure_exits_1_and_is_named(capsys, tmp_path):
    """A Linux dump of a Radeon whose amdgpu driver is not loaded (no /dev/kfd)."""
    dump = tmp_path / "no-kfd"
    dump.mkdir()
    shutil.copy(NAVI31_LSPCI / "lspci.txt", dump)
    (dump / "device-nodes.txt").write_text("/dev/kfd: absent\n/dev/dxg: absent\n")
    (dump / "proc-version.txt").write_text("Linux version 6.8.0-45-generic (buildd@lcy02) #45-Ubuntu SMP\n")
    code = main(["doctor", "--from", str(dump)])
    out = capsys.readouterr().out
    assert code == 1
    assert "The amdgpu kernel driver is not loaded (no /dev/kfd)" in out
    assert "Not ready: driver failed" in out
    code, report, _ = run_json(capsys, "doctor", "--json", "--from", str(dump))
    assert code == 1 and report["summary"]["failed_required"] == ["driver"]


def test_conflicting_options_and_bad_dumps_are_usage_errors(capsys, tmp_path):
    assert main(["doctor", "--from", str(WSL_4090), "--dump", str(tmp_path / "d")]) == 2
    assert main(["doctor", "--from", str(tmp_path / "nope")]) == 2
    assert "not a dump directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["doctor", "--from", str(tmp_path / "empty")]) == 2
    assert "no probe outputs here" in capsys.readouterr().err
    (tmp_path / "a-file").write_text("")
    assert main(["doctor", "--quick", "--dump", str(tmp_path / "a-file")]) == 2
    assert "cannot write the dump there" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["doctor", "--timeout", "0"])
    assert exit_info.value.code == 2 and "above 0" in capsys.readouterr().err


# --- doctor on this machine ---------------------------------------------------------------------------

def test_doctor_here_says_there_is_no_gpu_and_exits_0(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "No GPU found: training will run on the CPU (slow)" in out
    assert "No managed environment yet" in out and "fix: unsloth install" in out


def test_dump_then_from_round_trip(capsys, tmp_path):
    dump = tmp_path / "bug-report"
    code, live, err = run_json(capsys, "doctor", "--json", "--quick", "--dump", str(dump))
    assert code == 0 and (dump / "probes.json").is_file()
    assert f"Wrote every probe's raw output to {dump}" in err  # stderr: stdout stays JSON
    code, again, _ = run_json(capsys, "doctor", "--json", "--from", str(dump))
    assert code == 0
    assert again["platform"] == live["platform"] and again["plan"] == live["plan"]
    assert again["source"] == str(dump) and live["source"] == "live"
    # The dump carries the live answers, and `detect --from` the dump reproduces them exactly.
    assert json.loads((dump / "detect.json").read_text()) == live["platform"]
    assert json.loads((dump / "plan.json").read_text()) == live["plan"]
    code, detected, _ = run_json(capsys, "detect", "--json", "--from", str(dump))
    assert code == 0 and detected == live["platform"]


def test_doctor_quick_through_the_console_script_answers_fast(tmp_path):
    env = {**os.environ, "UNSLOTH_HOME": str(tmp_path / "home")}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "unsloth.cli", "doctor", "--json", "--quick"],
                          capture_output=True, text=True, env=env, timeout=60)
    elapsed = time.monotonic() - start
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert findings(report)["gpu"]["message"] == "No GPU found: training will run on the CPU (slow)"
    assert elapsed < 15  # about a second when the machine is idle; generous for loaded CI runners


def _managed_env_without_torch(home: Path) -> Path:
    """A managed environment whose Python works but holds no packages (a half-broken install)."""
    env = home / "envs" / "broken"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    write_receipt(env, Receipt("broken", finished="2026-11-29T00:00:00+00:00"))
    (home / "current").write_text("broken\n")
    return env


@pytest.mark.skipif(os.name != "posix", reason="POSIX venv layout")
def test_a_managed_environment_without_torch_fails_doctor(capsys, empty_home):
    _managed_env_without_torch(empty_home)
    code, report, _ = run_json(capsys, "doctor", "--json")
    found = findings(report)
    assert found["env"]["status"] == "ok"
    assert found["env-torch"]["status"] == "error"
    assert "ModuleNotFoundError" in found["env-torch"]["message"] and found["env-torch"]["fix"] == "unsloth install --force"
    assert "env-torch" in report["summary"]["failed_required"] and code == 1


@pytest.mark.skipif(os.name != "posix", reason="POSIX venv layout")
def test_doctor_python_runs_the_checks_in_that_interpreter(capsys, tmp_path):
    """--python points the environment checks at any interpreter: here one without torch.
    (tests/doctor runs them in this very .venv, where torch, bitsandbytes and Triton pass.)"""
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    code, report, _ = run_json(capsys, "doctor", "--json", "--python", str(bare / "bin" / "python"))
    found = findings(report)
    assert found["env"]["message"] == f"Checking {bare / 'bin' / 'python'} (given with --python)"
    assert found["env-torch"]["status"] == "error" and "No module named 'torch'" in found["env-torch"]["message"]
    assert found["env-matmul"]["message"] == "torch did not import"  # the probe ran on and said why
    assert code == 1 and "environment checks" in report["timings"]


def test_json_into_a_closed_pipe_ends_quietly():
    """`unsloth detect --json | head -1`: the reader leaves early; no traceback reaches the user."""
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "unsloth.cli", "detect", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    proc.stdout.close()  # the reader is gone before the first byte is written
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr


def test_a_crashing_check_is_an_error_finding_and_the_rest_still_prints(capsys, monkeypatch):
    """Doctor runs each check through a guard: the crash becomes an error finding with its traceback
    in `detail` (shown with --verbose), and every other check still reports."""
    from unsloth.doctor import checks

    def broken(platform):
        raise ZeroDivisionError("a bug in the memory check")

    code, whole, _ = run_json(capsys, "doctor", "--json", "--from", str(WSL_4090))
    monkeypatch.setattr(checks, "check_ram", broken)
    crashed_code, report, err = run_json(capsys, "doctor", "--json", "--from", str(WSL_4090))
    found = findings(report)
    assert [f["id"] for f in report["findings"]] == [f["id"] for f in whole["findings"]]  # nothing else lost
    ram = found["ram"]
    assert ram["status"] == "error" and "The check crashed (ZeroDivisionError: a bug in the memory check)" in ram["message"]
    assert ram["fix"] and "Traceback" in ram["detail"] and "a bug in the memory check" in ram["detail"]
    assert found["gpu"]["status"] == "ok" and "Traceback" not in err
    assert crashed_code == code  # the memory check is not a required one: the verdict stands

    assert main(["doctor", "--from", str(WSL_4090)]) == code
    out = capsys.readouterr().out
    assert "The check crashed (ZeroDivisionError" in out and "Traceback" not in out and "GPU driver" in out
    main(["doctor", "--from", str(WSL_4090), "--verbose"])
    assert "Traceback" in capsys.readouterr().out  # the detail, for a bug report


@pytest.mark.parametrize("size", [200_000, pytest.param(50 * 2**20, marks=pytest.mark.slow)])
def test_garbage_probe_outputs_are_unknown_facts_through_the_cli(capsys, tmp_path, size):
    """Issue #22: 200 KB of random bytes in nvidia-smi.txt once gave 677 phantom GPUs (rc 0), and 50 MB
    no answer in 300 s. Now: no GPU, unknown facts, quickly; doctor says so; nothing is written."""
    import random

    dump = tmp_path / "dump"
    dump.mkdir()
    (dump / "nvidia-smi.txt").write_bytes(random.Random(size).randbytes(size))
    before = sorted((p.name, p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))
    start = time.monotonic()
    code, platform, err = run_json(capsys, "detect", "--json", "--from", str(dump))
    assert code == 0 and platform["gpus"] == [] and platform["nvidia_driver"] is None and "Traceback" not in err
    code, report, err = run_json(capsys, "doctor", "--json", "--from", str(dump))
    assert time.monotonic() - start < 60  # not a speed goal: a guard against the quadratic parse
    assert report["platform"]["gpus"] == [] and "Traceback" not in err
    assert findings(report)["gpu"]["status"] != "ok"
    assert sorted((p.name, p.stat().st_mtime_ns) for p in tmp_path.rglob("*")) == before
