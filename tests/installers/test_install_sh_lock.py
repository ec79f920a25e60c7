"""install.sh's lock is the install lock `unsloth install` takes, whichever tool takes it: flock(1),
perl, or the Python found. Its functions run alone here (cut from the script), in two shells."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from unsloth.envs.lock import InstallLock

SCRIPT = Path(__file__).resolve().parents[2] / "install.sh"
NAMES = ("say", "warn", "die", "have", "take_lock", "lock_fd9")


def functions() -> str:
    text = SCRIPT.read_text()
    found = [re.search(rf"^{name}\(\) {{.*?^}}$|^{name}\(\) {{.*?}}$", text, re.S | re.M).group(0) for name in NAMES]
    return "\n".join(found)


HARNESS = '''
UNSLOTH_HOME=$1 PY=$2
take_lock
echo "locked $$"
read -r _
'''


@pytest.mark.parametrize("tool", ["flock", "perl", "python"])
def test_a_second_installer_waits_for_the_first(tmp_path, tool):
    if tool != "python" and not shutil.which(tool):
        pytest.skip(f"no {tool} here")
    tools = tmp_path / "bin"
    tools.mkdir()
    for name in ("cat", "sh", *(["flock"] if tool == "flock" else []), *(["perl"] if tool == "perl" else [])):
        os.symlink(shutil.which(name), tools / name)
    script = tmp_path / "harness.sh"
    script.write_text(functions() + HARNESS)
    home = tmp_path / "home"
    home.mkdir()
    py = sys.executable if tool == "python" else ""

    def start():
        return subprocess.Popen(["sh", str(script), str(home), py], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env={"PATH": str(tools)})

    first = start()
    assert first.stdout.readline().startswith("locked")
    second = start()
    assert f"Another unsloth install is running (pid {first.pid})" in second.stderr.readline()

    class Waited(Exception):
        pass

    def waited(who):
        raise Waited(who)

    with pytest.raises(Waited):  # the lock `unsloth install` takes: held by the first installer
        with InstallLock(home / "install.lock", on_wait=waited):
            pass
    first.communicate("\n", timeout=30)
    assert second.stdout.readline().startswith("locked")  # it got the lock once the first ended
    second.communicate("\n", timeout=30)
    assert first.returncode == 0 and second.returncode == 0
