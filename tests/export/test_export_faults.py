"""`unsloth export` killed at a point of its work, or stopped by a full disk, leaves only whole files
under final names: nothing partial, nothing that was not asked for; the next export there is clean.

The export runs in a child process that pauses at the chosen point and writes a marker; the test
waits for the marker (never for a time) and then signals it.
"""

from __future__ import annotations

import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from unsloth.export.files import PARTIAL

pytestmark = pytest.mark.slow

DRIVER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import llama_cpp
    import unsloth.export.gguf as gguf
    from unsloth.cli import main

    marker, point, argv = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]

    def pause():
        marker.write_text("paused")
        while True:
            time.sleep(0.05)

    def after(real):
        def wrapped(*args, **kwargs):
            status = real(*args, **kwargs)
            pause()
            return status
        return wrapped

    if point == "reference-written":  # the f16 is complete under its partial name, not yet renamed
        gguf.write_gguf = after(gguf.write_gguf)
    elif point == "quantized":  # llama.cpp wrote the quantized partial; the scratch f16 is beside it
        llama_cpp.llama_model_quantize = after(llama_cpp.llama_model_quantize)
    sys.exit(main(argv))
    """
)


def _final_names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith(".")) if directory.exists() else []


def _start(tmp_path: Path, point: str, argv: list[str]) -> subprocess.Popen:
    marker = tmp_path / f"marker-{point}"
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(marker), point, *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 300
    while not marker.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the export never reached {point}:\n{proc.communicate()[0][-3000:]}")
        time.sleep(0.05)
    return proc


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_export_leaves_no_file_at_all(tmp_path, saved_model, how):
    out = tmp_path / "out"
    proc = _start(tmp_path, "reference-written", ["export", str(saved_model("llama")), "--gguf", "f16",
                                                   "--out", str(out), "--no-validate"])
    proc.send_signal(how)
    text, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, text[-2000:]
    assert "Traceback" not in text
    assert sorted(p.name for p in out.iterdir()) == []  # no .partial-PID file either


def test_a_killed_quantize_leaves_no_unrequested_f16_and_the_next_export_sweeps(tmp_path, saved_model):
    out = tmp_path / "out"
    argv = ["export", str(saved_model("llama")), "--gguf", "q8_0", "--out", str(out), "--name", "model",
            "--no-validate"]
    proc = _start(tmp_path, "quantized", argv)
    proc.kill()
    proc.wait()
    assert _final_names(out) == []  # the f16 reference was never given its final name
    left = sorted(p.name for p in out.iterdir())
    assert left == sorted(PARTIAL.format(name=n, pid=proc.pid) for n in ("model.F16.gguf", "model.Q8_0.gguf"))
    again = subprocess.run([sys.executable, "-m", "unsloth.cli", *argv], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["model.Q8_0.gguf"]  # the dead run's partials are gone


def _limit_file_size(limit: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    return apply


def test_a_full_disk_during_export_is_one_message_and_no_file(tmp_path, saved_model):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "unsloth.cli", "export", str(saved_model("llama")), "--gguf", "f16",
                           "--out", str(out), "--name", "model", "--no-validate"], capture_output=True, text=True,
                          timeout=300, preexec_fn=_limit_file_size(200_000))
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert "while writing model.F16.gguf" in done.stderr and "nothing was written under model.F16.gguf" in done.stderr
    assert sorted(p.name for p in out.iterdir()) == []
