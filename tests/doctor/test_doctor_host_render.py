"""Live host facts gathered on this machine, and how findings are shown."""

from __future__ import annotations

import getpass
import os
import shutil

import pytest
from rich.console import Console

from unsloth.doctor import render
from unsloth.doctor.findings import Finding, exit_code, summarize
from unsloth.doctor.host import gather_host_facts


def test_rc_lines_that_set_the_override_are_found_with_their_line_numbers(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".bashrc").write_text("alias ll='ls -l'\nexport HSA_OVERRIDE_GFX_VERSION=10.3.0\n"
                                      "# HSA_OVERRIDE_GFX_VERSION=9 in a comment\n")
    (tmp_path / ".profile").write_text("HSA_OVERRIDE_GFX_VERSION_1=11.0.0\n")
    facts = gather_host_facts(tmp_path / "not" / "created" / "yet")
    assert [(line.path, line.lineno, line.text) for line in facts.rc_overrides] == [
        ("~/.bashrc", 2, "export HSA_OVERRIDE_GFX_VERSION=10.3.0"),
        ("~/.profile", 1, "HSA_OVERRIDE_GFX_VERSION_1=11.0.0"),
    ]


def test_facts_of_this_machine(tmp_path):
    facts = gather_host_facts(tmp_path / "missing")  # disk space of the nearest existing parent
    assert facts.user == getpass.getuser()
    assert (facts.kfd is not None) == os.path.exists("/dev/kfd")
    assert facts.wsl_lib_dir == os.path.isdir("/usr/lib/wsl/lib")
    assert 0 < facts.disk_free_bytes <= shutil.disk_usage(tmp_path).total
    if os.name == "posix":
        import grp

        assert grp.getgrgid(os.getegid()).gr_name in facts.groups  # the primary group counts too


def test_invalid_status_is_refused():
    with pytest.raises(ValueError, match="not one of"):
        Finding("x", "X", "fine", "?")


def test_only_required_errors_decide_the_exit_code():
    optional = Finding("llama", "llama.cpp", "error", "broken")
    required = Finding("torch", "torch", "error", "broken", required=True)
    assert exit_code([optional, Finding("gpu", "GPU", "warning", "none")]) == 0
    assert exit_code([optional, required]) == 1
    summary = summarize([optional, required, Finding("a", "A", "ok", "fine")])
    assert summary == {"ok": 1, "warning": 0, "error": 2, "skipped": 0, "failed_required": ["torch"], "exit_code": 1}


def rendered(findings, verbose=False) -> str:
    out = Console(record=True, width=200)
    render.print_findings(findings, summarize(findings), verbose=verbose, out=out)
    return out.export_text()


def test_fixes_print_under_problems_and_skips_of_one_reason_share_a_line():
    findings = [
        Finding("gpu", "GPU", "warning", "No GPU found", fix="install a driver"),
        Finding("ram", "Memory", "ok", "32 GiB RAM", fix="never shown for ok"),
        Finding("env-torch", "torch", "skipped", "No environment"),
        Finding("env-gpu", "torch sees the GPU", "skipped", "No environment"),
        Finding("env-matmul", "Matrix multiply", "error", "wrong", fix="unsloth install", required=True,
                detail="max error 3.0"),
    ]
    lines = rendered(findings).splitlines()
    assert lines[0].split() == ["!", "GPU", "No", "GPU", "found"]
    assert lines[1].strip() == "fix: install a driver"
    assert "never shown" not in "\n".join(lines)
    assert lines[3].split()[:3] == ["-", "2", "checks"] and lines[3].endswith("No environment: torch, torch sees the GPU")
    assert lines[-1] == "Not ready: env-matmul failed (1 ok, 1 warning, 1 error, 2 skipped)"
    assert "max error 3.0" not in "\n".join(lines)
    verbose = rendered(findings, verbose=True)
    assert "max error 3.0" in verbose and "2 checks" not in verbose


def test_summary_lines():
    ok = [Finding("a", "A", "ok", "fine")]
    assert render.summary_line(summarize(ok)).plain == "Ready (1 ok)"
    warned = ok + [Finding("b", "B", "warning", "meh"), Finding("c", "C", "warning", "meh")]
    assert render.summary_line(summarize(warned)).plain == "Ready, with warnings (1 ok, 2 warnings)"


def test_a_uid_without_a_name_still_gathers(tmp_path, monkeypatch):
    def no_name():
        raise KeyError("getpwuid(): uid not found: 12345")  # what a container's bare uid gives

    monkeypatch.setattr(getpass, "getuser", no_name)
    facts = gather_host_facts(tmp_path)
    assert facts.user == (str(os.getuid()) if hasattr(os, "getuid") else "?")


def test_probe_text_that_looks_like_markup_prints_verbatim():
    from unsloth.platform.facts import Gpu, Platform

    gpu = Gpu(vendor="amd", name="[/odd] GPU [bold]", pci_id="1002:744c", sources=["lspci"])
    platform = Platform(os="linux", cpu="[/proc] cpu", gpus=[gpu], notes=["[/x] note"])
    out = Console(width=200, record=True)
    render.print_platform(platform, out)
    text = out.export_text()
    assert "[/odd] GPU [bold]" in text and "[/proc] cpu" in text and "[/x] note" in text


def test_an_override_is_not_set_when_the_environment_was_read_and_unknown_otherwise():
    from unsloth.platform.facts import Platform

    def shown(platform):
        out = Console(width=200, record=True)
        render.print_platform(platform, out)
        return next(line for line in out.export_text().splitlines() if "HSA override" in line)

    assert "not set" in shown(Platform(os="linux", probes={"env": "ok"}))
    assert "unknown" in shown(Platform(os="linux", probes={}))
    assert "11.0.0" in shown(Platform(os="linux", probes={"env": "ok"}, hsa_override="11.0.0"))
