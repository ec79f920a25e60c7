"""`unsloth train` stopped while it writes a checkpoint (SIGKILL, SIGTERM) resumes from the last
complete one; the half-written folder is removed, never read.

The run pauses inside the Trainer's checkpoint writing (weights and optimizer written, trainer_state
not yet) and writes a marker; the test waits for the marker, never for a time, then signals it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tiny_setup import write_dataset, write_tiny_model

pytestmark = pytest.mark.slow

DRIVER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from transformers import Trainer
    from unsloth.cli import main

    marker, argv = Path(sys.argv[1]), sys.argv[2:]
    real = Trainer._save_rng_state

    def paused(self, output_dir):
        if self.state.global_step == 2:
            marker.write_text(output_dir)
            while True:
                time.sleep(0.05)
        return real(self, output_dir)

    Trainer._save_rng_state = paused
    sys.exit(main(argv))
    """
)


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    model, data = write_tiny_model(root / "model"), write_dataset(root / "data.jsonl")
    path = root / "train.toml"
    path.write_text(textwrap.dedent(f"""
        [model]
        name = "{model}"
        max_seq_length = 32
        dtype = "float32"
        [dataset]
        name = "{data}"
        [training]
        max_steps = 3
        per_device_train_batch_size = 2
        gradient_accumulation_steps = 1
        save_strategy = "steps"
        save_steps = 1
        logging_steps = 1
    """))
    return path


# SIGKILL: nothing of ours runs; SIGTERM: the interrupt path, which must not tidy a half-written folder into a final one.
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_a_run_stopped_while_checkpointing_resumes_from_the_last_complete_one(config, tmp_path, how):
    out = tmp_path / "run"
    env = {**os.environ, "UNSLOTH_KERNELS": "0"}  # the checkpoints are under test, not the kernels
    marker = tmp_path / "marker"
    argv = ["train", str(config), "--output-dir", str(out)]
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(marker), *argv], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600
    while not marker.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("the run never reached its second checkpoint:\n" + proc.communicate()[0][-3000:])
        time.sleep(0.05)
    proc.send_signal(how)
    text, _ = proc.communicate(timeout=120)
    assert "Traceback" not in text
    half = out / "checkpoint-2"
    assert half.is_dir() and not (half / "trainer_state.json").exists()  # cut off while being written

    resumed = subprocess.run([sys.executable, "-m", "unsloth.cli", *argv, "--resume"], env=env, capture_output=True,
                             text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    said = resumed.stdout + resumed.stderr
    assert "removed checkpoint-2: the run stopped while writing it" in said
    assert f"resuming from {out / 'checkpoint-1'}" in said
    for step in (1, 2, 3):
        state = json.loads((out / f"checkpoint-{step}" / "trainer_state.json").read_text())
        assert state["global_step"] == step
    records = [json.loads(line) for line in (out / "loss_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]  # each step's loss once, in order
    assert (out / "lora" / "adapter_model.safetensors").is_file()


FULL_AT_STEP_2 = textwrap.dedent(
    """
    import errno, os, sys
    from transformers import Trainer
    from unsloth.cli import main

    real = Trainer._save_rng_state

    def full(self, output_dir):  # the disk fills up inside the second checkpoint, after its weights
        if self.state.global_step == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), output_dir)
        return real(self, output_dir)

    Trainer._save_rng_state = full
    sys.exit(main(sys.argv[1:]))
    """
)


def _limit_file_size(limit: int):
    def apply() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    return apply


def test_a_file_size_limit_while_checkpointing_is_one_message_and_no_half_checkpoint(config, tmp_path):
    """A real refused write (safetensors' own I/O error, no errno on it): one message, exit 1, and no
    checkpoint folder left half-written under its final name."""
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "unsloth.cli", "train", str(config), "--output-dir", str(out)],
                          env={**os.environ, "UNSLOTH_KERNELS": "0"}, capture_output=True, text=True, timeout=600,
                          preexec_fn=_limit_file_size(100_000))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "a bug in unsloth" not in done.stderr
    assert f"the disk filled up (or a file-size limit was reached) while writing to {out}" in done.stderr
    assert "no checkpoint was complete yet" in done.stderr and "fix: free space on that disk" in done.stderr
    assert not list(out.glob("checkpoint-*"))


def test_a_disk_full_at_the_second_checkpoint_resumes_from_the_first(config, tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "UNSLOTH_KERNELS": "0"}
    argv = ["train", str(config), "--output-dir", str(out)]
    done = subprocess.run([sys.executable, "-c", FULL_AT_STEP_2, *argv], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stdout[-3000:] + done.stderr[-3000:]
    assert "removed checkpoint-2: the run stopped while writing it" in done.stdout
    assert "the checkpoints written to the end are kept (the last: checkpoint-1)" in done.stderr
    assert "add --resume to continue from checkpoint-1" in done.stderr
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]

    resumed = subprocess.run([sys.executable, "-m", "unsloth.cli", *argv, "--resume"], env=env, capture_output=True,
                             text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resuming from {out / 'checkpoint-1'}" in resumed.stdout + resumed.stderr
    assert (out / "lora" / "adapter_model.safetensors").is_file()
