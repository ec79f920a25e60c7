"""Probes (real subprocesses, fake tools on PATH) and dump write/read round trips."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest

from unsloth.platform.detect import detect, detect_from_dump, detect_live
from unsloth.platform.dump import read_dump, write_dump
from unsloth.platform.facts import ProbeResult
from unsloth.platform.parsers import drm, kfd
from unsloth.platform.probes import drm_cards, kfd_nodes, run_command, run_probes

pytestmark = pytest.mark.skipif(os.name == "nt", reason="fake tools are POSIX shell scripts")


def fake_tool(directory: Path, name: str, body: str) -> None:
    path = directory / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def tools(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return bin_dir


def test_absent_tool(tools):
    result = run_command("nvidia-smi", ("surely-not-a-tool-on-path",), timeout=1)
    assert (result.status, result.text) == ("absent", "")


def test_failing_tool_keeps_its_output(tools):
    fake_tool(tools, "rocminfo", 'echo "ROCk module is NOT loaded, possibly no GPU devices"; exit 1\n')
    result = run_command("rocminfo", ("rocminfo",), timeout=5)
    assert result.status == "failed" and "NOT loaded" in result.text and "exit code 1" in result.detail


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process state from /proc")
def test_hung_tool_is_killed_with_its_children(tools, tmp_path):
    pid_file = tmp_path / "child.pid"
    fake_tool(tools, "nvidia-smi", f"sleep 60 &\necho $! > {pid_file}\nwait\n")
    started = time.monotonic()
    result = run_command("nvidia-smi", ("nvidia-smi",), timeout=0.5)
    assert result.status == "timeout"
    assert time.monotonic() - started < 5
    child = Path(f"/proc/{int(pid_file.read_text())}/stat")
    time.sleep(0.1)
    # Gone, or a zombie waiting for init to reap it: either way, no longer running.
    assert not child.exists() or child.read_text().split(")")[-1].split()[0] == "Z"


@pytest.mark.skipif(not Path("/usr/bin/setsid").exists() and not Path("/bin/setsid").exists(), reason="needs setsid")
def test_a_detached_grandchild_holding_the_pipe_cannot_hang_detection(tools):
    """Killing the tool's group misses a grandchild that left it (Windows: a kill never reaches
    grandchildren); waiting for the pipe to close would then last as long as that grandchild."""
    fake_tool(tools, "nvidia-smi", "setsid sleep 30 &\nsleep 30\n")
    started = time.monotonic()
    result = run_command("nvidia-smi", ("nvidia-smi",), timeout=0.5)
    assert result.status == "timeout" and time.monotonic() - started < 15


def test_override_is_rerun_without_it(tools, monkeypatch):
    fake_tool(tools, "rocminfo", 'echo "  Name: gfx${HSA_OVERRIDE_GFX_VERSION:-none}"\n')
    monkeypatch.setenv("HSA_OVERRIDE_GFX_VERSION", "11.0.0")
    results = run_probes(timeout=5, platform="linux")
    assert "11.0.0" in results["rocminfo"].text
    assert "gfxnone" in results["rocminfo-no-override"].text
    assert results["env"].text == "HSA_OVERRIDE_GFX_VERSION=11.0.0"


def test_probes_fit_the_os():
    linux = run_probes(timeout=5, platform="linux")
    assert "win32-videocontroller" not in linux and "system-profiler" not in linux
    windows = run_probes(timeout=5, platform="win32")
    assert "win32-videocontroller" in windows and "rocminfo" not in windows


def test_detect_live_is_quick_and_a_dump_reproduces_it(tmp_path):
    started = time.monotonic()
    platform, results = detect_live(timeout=5)
    assert time.monotonic() - started < 3
    assert results["host"].status == "ok" and platform.cpu
    write_dump(tmp_path / "dump", results)
    assert detect_from_dump(tmp_path / "dump")[0] == platform


def test_dump_round_trip_keeps_statuses_texts_and_details(tmp_path):
    results = {
        "nvidia-smi": ProbeResult("nvidia-smi", "timeout", detail="nvidia-smi: no answer within 5 s"),
        "rocminfo": ProbeResult("rocminfo", "failed", "ROCk module is NOT loaded\n", "rocminfo: exit code 1"),
        "lspci": ProbeResult(
            "lspci", "ok", "03:00.0 VGA compatible controller [0300]: x [1002:744c]\n", "lspci -D -nn"
        ),
    }
    write_dump(tmp_path, results)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lspci.txt", "probes.json", "rocminfo.txt"]
    assert read_dump(tmp_path) == results


def test_dump_written_by_hand_without_index(tmp_path):
    (tmp_path / "lspci.txt").write_bytes(
        "03:00.0 VGA compatible controller [0300]: AMD [1002:744c]\r\n".encode("utf-16")
    )
    (tmp_path / "notes.md").write_text("ignored")
    results = read_dump(tmp_path)
    assert list(results) == ["lspci"]
    assert results["lspci"].status == "ok" and results["lspci"].text.endswith("[1002:744c]\n")
    assert detect(results).gpus[0].arch == "gfx1100"


def test_damaged_index_loses_only_statuses(tmp_path):
    (tmp_path / "probes.json").write_text("{not json")
    (tmp_path / "proc-version.txt").write_text("Linux version 6.8.0-45-generic (buildd@lcy02)")
    assert read_dump(tmp_path)["proc-version"].status == "ok"
    (tmp_path / "probes.json").write_text(json.dumps({"rocminfo": {"status": "absent", "detail": "not on PATH"}}))
    assert read_dump(tmp_path)["rocminfo"] == ProbeResult("rocminfo", "absent", "", "not on PATH")


def test_missing_dump_directory_says_how_to_make_one(tmp_path):
    with pytest.raises(NotADirectoryError, match="unsloth doctor --dump"):
        read_dump(tmp_path / "nope")


def test_sysfs_probes_gather_cards_and_nodes(tmp_path):
    pci = tmp_path / "devices" / "pci0000:00" / "0000:03:00.0"
    pci.mkdir(parents=True)
    for name, value in {
        "vendor": "0x1002",
        "device": "0x744c",
        "class": "0x030000",
        "boot_vga": "1",
        "mem_info_vram_total": "25753026560",
    }.items():
        (pci / name).write_text(value + "\n")
    drm_dir = tmp_path / "class" / "drm"
    for card in ("card1", "card1-DP-1"):  # a card and one of its connectors
        (drm_dir / card).mkdir(parents=True)
        (drm_dir / card / "device").symlink_to(pci)
    (drm_dir / "renderD128").mkdir()
    text = drm_cards(str(tmp_path))
    assert text.count("== ") == 1 and "pci_address: 0000:03:00.0" in text
    (gpu,) = drm.parse(text).gpus
    assert (gpu.pci_id, gpu.bus_id, gpu.vram_bytes) == ("1002:744c", "0000:03:00.0", 25753026560)

    nodes = tmp_path / "class" / "kfd" / "kfd" / "topology" / "nodes"
    for node, props in {
        "0": "cpu_cores_count 16\nsimd_count 0\n",
        "1": "simd_count 192\ngfx_target_version 110000\n",
    }.items():
        (nodes / node).mkdir(parents=True)
        (nodes / node / "properties").write_text(props)
    assert [g.arch for g in kfd.parse(kfd_nodes(str(tmp_path))).gpus] == ["gfx1100"]
    assert kfd_nodes(str(tmp_path / "nowhere")) is None and drm_cards(str(tmp_path / "nowhere")) is None
