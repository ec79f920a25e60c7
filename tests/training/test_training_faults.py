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
