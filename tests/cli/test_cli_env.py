"""`unsloth env`: what a user sees with no environment, a finished one, and a damaged receipt."""

from __future__ import annotations

import json

from unsloth.cli import main
from unsloth.envs.receipt import Receipt, write_receipt


def _env(home, receipt: Receipt | None):
    env = home / "envs" / "one"
    env.mkdir(parents=True)
    if receipt is not None:
        write_receipt(env, receipt)
    else:
        (env / "receipt.json").write_text('{"schema": 99}')  # a newer unsloth's receipt
    (home / "current").write_text("one\n")
    return env


def test_export_writes_a_lock_and_counts_its_packages(tmp_path, monkeypatch, capsys):
    home = tmp_path / "home"
    monkeypatch.setenv("UNSLOTH_HOME", str(home))
    _env(home, Receipt("one", finished="2026-11-29T00:00:00+00:00", plan={"torch": {"backend": "cpu"}},
                       indexes={"torch": {"mode": "index", "url": "https://download.pytorch.org/whl/cpu"}},
                       unsloth={"source": str(tmp_path)}, packages={"torch": "2.13.0+cpu", "peft": "0.18.0"}))
    lock = tmp_path / "lock.txt"
    assert main(["env", "export", "-o", str(lock)]) == 0
    assert "(2 packages) from one" in capsys.readouterr().err
    assert "torch==2.13.0+cpu" in lock.read_text() and "--extra-index-url https://download.pytorch.org/whl/cpu" in lock.read_text()


def test_export_of_an_unreadable_receipt_is_a_message_not_a_traceback(tmp_path, monkeypatch, capsys):
    home = tmp_path / "home"
    monkeypatch.setenv("UNSLOTH_HOME", str(home))
    _env(home, None)
    assert main(["env", "export"]) == 1
    assert "unsloth install --force" in capsys.readouterr().err


def test_list_without_environments(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("UNSLOTH_HOME", str(tmp_path / "home"))
    assert main(["env", "list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []
    assert main(["env", "path"]) == 1
    assert "run `unsloth install`" in capsys.readouterr().err


def test_a_garbage_current_pointer_is_said_and_repaired(tmp_path, monkeypatch, capsys):
    """Random bytes in `current` beside a finished environment: one note on stderr, the pointer names
    that environment again, and the command answers."""
    import os

    home = tmp_path / "home"
    monkeypatch.setenv("UNSLOTH_HOME", str(home))
    env = _env(home, Receipt("one", finished="2026-11-29T00:00:00+00:00", unsloth={"source": str(tmp_path)}))
    (home / "current").write_bytes(os.urandom(200).replace(b"\n", b"x"))
    assert main(["env", "path"]) == 0
    out, err = capsys.readouterr()
    assert out == f"{env}\n" and "Traceback" not in err
    assert f"unsloth env: {home / 'current'} is damaged" in err and "repaired: it names one again" in err
    assert (home / "current").read_text() == "one\n"
    assert main(["env", "path"]) == 0 and capsys.readouterr().err == ""  # repaired once, for good
