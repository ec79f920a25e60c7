"""`unsloth update` asks uv whether anything newer exists (`--dry-run --upgrade` against the active
environment) before it builds: nothing newer, nothing built. A stand-in uv answers as uv does."""

from __future__ import annotations

import contextlib
import sys

import pytest
from rich.console import Console

from unsloth.commands import render
from unsloth.envs import manager, state
from unsloth.envs.build import request_hash, source_identity
from unsloth.envs.receipt import Receipt, hardware_fingerprint, write_receipt
from unsloth.envs.steps import Request
from unsloth.matrix import load_matrix
from unsloth.plan import resolve
from unsloth.platform.facts import Platform

FAKE_UV = """#!/bin/sh
printf '%s\\n' "$*" >> "$FAKE_UV_LOG"
echo "Resolved 12 packages in 3ms"
echo "$FAKE_UV_ANSWER"
"""


@pytest.fixture
def active(tmp_path, monkeypatch):
    """An active environment built from exactly this request, and a stand-in uv."""
    root = tmp_path / "home"
    platform = Platform(os="linux")
    plan = resolve(platform, load_matrix())
    request = Request(source=str(tmp_path / "src"), without=("llama-cpp",))
    (tmp_path / "src").mkdir()
    env = root / "envs" / "a"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # has this package's metadata
    (env / "bin" / "python").chmod(0o755)
    (env / "unsloth-pins.txt").write_text("torch==2.13.0\n")
    wanted = request_hash(request, plan.to_json(), source_identity(request.source), hardware_fingerprint(platform.to_json()))
    write_receipt(env, Receipt("a", request_hash=wanted, python={"version": "3.11.7"}))
    state.switch(root, "a")
    uv = tmp_path / "uv"
    uv.write_text(FAKE_UV)
    uv.chmod(0o755)
    monkeypatch.setenv("UNSLOTH_UV", str(uv))
    monkeypatch.setenv("FAKE_UV_LOG", str(tmp_path / "uv.log"))
    monkeypatch.setenv("UNSLOTH_BIN_DIR", str(tmp_path / "bin"))
    options = manager.Options(request=request, root=root, upgrade=True, modify_path=False)
    return options, plan, platform, tmp_path


def _update(active) -> tuple[int, str]:
    """The outcome's exit code and what it and its progress said (as `unsloth update` shows them)."""
    options, plan, platform, tmp_path = active
    screen = tmp_path / "screen"
    with open(screen, "w") as out, contextlib.redirect_stdout(out):
        code = render.show(manager.install(options, plan, platform, Console(file=out, width=200)))
    return code, screen.read_text()


def test_nothing_newer_is_decided_before_anything_is_built(active, monkeypatch):
    monkeypatch.setenv("FAKE_UV_ANSWER", "Would make no changes")
    monkeypatch.setattr(manager, "build", lambda *a, **k: pytest.fail("built although nothing was newer"))
    code, said = _update(active)
    assert code == 0 and "Up to date: a already has the newest versions" in said
    asked = (active[3] / "uv.log").read_text().splitlines()
    assert len(asked) >= 2 and all(line.endswith("--dry-run --upgrade") for line in asked)
    assert all("--reinstall-package" not in line for line in asked)
    packages = next(line for line in asked if "transformers" in line)  # what our package requires, not itself
    assert "unsloth-installer" not in packages and "platformdirs" in packages


def test_something_newer_builds(active, monkeypatch):
    monkeypatch.setenv("FAKE_UV_ANSWER", "Would install 1 package\n + trl==0.99.0")
    built = []

    def build(root, request, plan, platform, console, use_pip=False):
        built.append(request)
        raise KeyboardInterrupt  # far enough: the build was started

    monkeypatch.setattr(manager, "build", build)
    code, _ = _update(active)
    assert built and code == 130
