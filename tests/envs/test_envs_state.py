"""Pointers, switching, rollback, sweeping, receipts, the launcher and the PATH line, on real files."""

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from unsloth.envs import launcher, state
from unsloth.envs.paths import active_env, env_python, home, previous_env
from unsloth.envs.receipt import SCHEMA, Receipt, hardware_fingerprint, read_receipt, write_receipt


def make_env(root: Path, name: str, finished: bool = True) -> Path:
    env = root / "envs" / name
    (env / "bin").mkdir(parents=True)
    if finished:
        write_receipt(env, Receipt(name, finished="2026-01-01T00:00:00+00:00"))
    return env


def test_home_is_overridable(monkeypatch, tmp_path):
    monkeypatch.setenv("UNSLOTH_HOME", str(tmp_path / "h"))
    assert home() == tmp_path / "h"
    monkeypatch.delenv("UNSLOTH_HOME")
    assert home().name == "unsloth"


def test_nothing_active_until_a_finished_env_is_pointed_at(tmp_path):
    assert active_env(tmp_path) is None
    make_env(tmp_path, "a", finished=False)
    (tmp_path / "current").write_text("a\n")
    assert active_env(tmp_path) is None  # no receipt: unfinished
    (tmp_path / "current").write_text("../../etc\n")
    assert active_env(tmp_path) is None  # never outside envs/


def test_switch_and_rollback_swap_current_and_previous(tmp_path):
    a, b = make_env(tmp_path, "a"), make_env(tmp_path, "b")
    state.switch(tmp_path, "a")
    assert active_env(tmp_path) == a and previous_env(tmp_path) is None
    state.switch(tmp_path, "b")
    assert active_env(tmp_path) == b and previous_env(tmp_path) == a
    assert state.rollback(tmp_path) == ("b", "a")
    assert active_env(tmp_path) == a and previous_env(tmp_path) == b
    assert env_python(a) == a / "bin" / "python"


def test_rollback_without_previous_changes_nothing(tmp_path):
    make_env(tmp_path, "a")
    state.switch(tmp_path, "a")
    assert state.rollback(tmp_path) is None
    assert active_env(tmp_path).name == "a"


def test_sweep_removes_unfinished_builds_and_on_request_old_ones(tmp_path):
    for name in ("a", "b", "c"):
        make_env(tmp_path, name)
    make_env(tmp_path, "killed", finished=False)
    state.switch(tmp_path, "b")
    state.switch(tmp_path, "c")
    assert state.sweep(tmp_path) == ["killed"]
    assert state.sweep(tmp_path, keep_finished=False) == ["a"]
    assert sorted(p.name for p in (tmp_path / "envs").iterdir()) == ["b", "c"]


def test_receipt_round_trip_and_unreadable_receipts(tmp_path):
    env = tmp_path / "e"
    write_receipt(env, Receipt("e", packages={"torch": "2.13.0+cpu"}))
    assert read_receipt(env) == Receipt("e", packages={"torch": "2.13.0+cpu"})
    written = json.loads((env / "receipt.json").read_text())
    assert written["schema"] == SCHEMA and written["name"] == "e" and written["packages"] == {"torch": "2.13.0+cpu"}
    assert [p.name for p in env.iterdir()] == ["receipt.json"]  # no temp file left behind
    (env / "receipt.json").write_text(json.dumps({"schema": SCHEMA + 1}))
    assert read_receipt(env) is None
    (env / "receipt.json").write_text("{truncated")
    assert read_receipt(env) is None
    (env / "receipt.json").write_text(json.dumps({"schema": SCHEMA, "packages": {}}))  # no name
    assert read_receipt(env) is None
    # a key a later schema-1 unsloth added is skipped, not fatal
    (env / "receipt.json").write_text(json.dumps({"schema": SCHEMA, "name": "e", "added_later": 1}))
    assert read_receipt(env) == Receipt("e")


def test_fingerprint_changes_with_the_gpu_not_with_unrelated_facts():
    base = {"os": "linux", "machine": "x86_64", "gpus": [{"vendor": "nvidia", "arch": "sm_89", "pci_id": "10de:2684"}]}
    assert hardware_fingerprint(base) == hardware_fingerprint({**base, "notes": ["x"], "kernel": "6.9"})
    assert hardware_fingerprint(base) != hardware_fingerprint({**base, "gpus": [{"vendor": "amd", "arch": "gfx1100"}]})
    assert hardware_fingerprint(base) != hardware_fingerprint({**base, "nvidia_driver": "590.1"})


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX launcher")
def test_launcher_runs_the_current_environment(tmp_path):
    root = tmp_path / "home with space"
    env = make_env(root, "a")
    (env / "bin" / "unsloth").write_text('#!/bin/sh\necho "env a: $*"\n')
    (env / "bin" / "unsloth").chmod(0o755)
    script = launcher.write_launcher(root, tmp_path / "bin")
    missing = subprocess.run([str(script)], capture_output=True, text=True)
    assert missing.returncode == 1 and "no environment is installed" in missing.stderr
    state.switch(root, "a")
    done = subprocess.run([str(script), "doctor", "--json"], capture_output=True, text=True, check=True)
    assert done.stdout == "env a: doctor --json\n"
    assert launcher.is_ours(script) and not launcher.is_ours(tmp_path / "nope")


def test_path_line_is_added_once_and_removed_exactly(tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / ".bashrc").write_text("alias ll='ls -l'")  # no trailing newline
    (user / ".config" / "fish").mkdir(parents=True)
    bin_dir = tmp_path / "bin"
    changed = launcher.add_to_path(bin_dir, user, shell="")
    assert sorted(p.name for p in changed) == [".bashrc", ".profile", "unsloth.fish"]
    assert launcher.add_to_path(bin_dir, user, shell="") == []  # a re-run adds nothing
    bashrc = (user / ".bashrc").read_text()
    assert bashrc.count(launcher.MARKER) == 1 and bashrc.startswith("alias ll='ls -l'\n")
    # the line itself works in sh and never duplicates PATH entries
    line = launcher.path_line(bin_dir)
    out = subprocess.run(["sh", "-c", f'{line}\n{line}\necho "$PATH"'], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin"}, check=True).stdout.strip()
    assert out == f"{bin_dir}:/usr/bin:/bin"
    launcher.remove_from_path(bin_dir, user)
    assert (user / ".bashrc").read_text() == "alias ll='ls -l'\n"
    assert not (user / ".profile").exists()  # it held only our line: we had created it
    assert not launcher.fish_file(user).exists()


@pytest.mark.parametrize("shell, read_by_a_new_window", [
    ("bash", ".bashrc"), ("zsh", ".zshrc"), ("fish", ".config/fish/conf.d/unsloth.fish"), ("sh", None)])
def test_a_fresh_home_gets_the_path_line_where_the_users_shell_reads_it(tmp_path, shell, read_by_a_new_window):
    user = tmp_path / "user"
    user.mkdir()
    changed = launcher.add_to_path(tmp_path / "bin", user, shell=launcher.login_shell({"SHELL": f"/usr/bin/{shell}"}))
    names = sorted(str(p.relative_to(user)) for p in changed)
    assert names == sorted([".profile"] + ([read_by_a_new_window] if read_by_a_new_window else []))
    launcher.remove_from_path(tmp_path / "bin", user)
    assert sorted(p.name for p in user.rglob("*") if p.is_file()) == []


def test_update_reads_what_the_active_environment_was_asked_for(tmp_path):
    from unsloth.envs.manager import active_request

    assert active_request(tmp_path) == {}
    env = make_env(tmp_path, "a")
    write_receipt(env, Receipt("a", request={"without": ["llama-cpp"], "source": "/src"}))
    state.switch(tmp_path, "a")
    assert active_request(tmp_path) == {"without": ["llama-cpp"], "source": "/src"}


def test_uninstall_says_which_caches_it_leaves_and_purge_removes_ours(tmp_path, monkeypatch):
    from rich.console import Console

    from unsloth.commands import render
    from unsloth.envs import manager
    from unsloth.envs.paths import build_caches

    root, user = tmp_path / "home", tmp_path / "user"
    for name in ("UV_CACHE_DIR", "PIP_CACHE_DIR", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(user))
    monkeypatch.setenv("UNSLOTH_BIN_DIR", str(tmp_path / "bin"))
    caches = build_caches(root, {})
    assert caches == {"UV_CACHE_DIR": str(root / "cache" / "uv"), "PIP_CACHE_DIR": str(root / "cache" / "pip")}
    assert build_caches(root, {"UV_CACHE_DIR": "/mine"})["UV_CACHE_DIR"] == "/mine"  # the user's choice stands
    (root / "cache" / "uv").mkdir(parents=True)
    (root / "cache" / "uv" / "wheel.whl").write_bytes(b"x" * 3 * 1024**2)
    (user / ".cache" / "huggingface").mkdir(parents=True)
    (user / ".cache" / "huggingface" / "model.bin").write_bytes(b"w" * 1024**2)
    (root / "envs" / "a").mkdir(parents=True)

    def uninstall(purge):
        screen = tmp_path / "screen"
        with open(screen, "w") as handle, contextlib.redirect_stdout(handle):
            assert render.show(manager.uninstall(root, Console(file=handle, width=300), purge=purge)) == 0
        return screen.read_text()

    said = uninstall(purge=False)
    assert f"kept {root / 'cache'} (3 MB): our build caches" in said and "`unsloth uninstall --purge` removes them" in said
    assert f"kept {user / '.cache' / 'huggingface'} (1 MB): Hugging Face" in said
    assert (root / "cache" / "uv" / "wheel.whl").is_file() and not (root / "envs").exists()
    said = uninstall(purge=True)
    assert "our build caches" not in said and "Hugging Face" in said
    assert not root.exists() and (user / ".cache" / "huggingface" / "model.bin").is_file()
