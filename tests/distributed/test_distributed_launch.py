"""`unsloth train CONFIG --gpus N`: torchrun started for the user, rank 0 alone reporting, a failing
rank stopping the job with its message, a SIGTERM stopping every rank. On the CPU the ranks are
gloo processes (UNSLOTH_DISTRIBUTED_CPU=1)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tiny_setup import write_dataset, write_tiny_model
from unsloth.training.config import ConfigError
from unsloth.training.launch import gpu_count, torchrun_command


def test_gpu_count_reads_numbers_and_all():
    assert gpu_count("2", visible=4) == 2
    assert gpu_count("all", visible=8) == 8
    assert gpu_count("3", visible=0, cpu_processes=True) == 3


@pytest.mark.parametrize("value, visible, platform, match", [
    ("4", 2, "linux", "only 2 GPU"), ("all", 0, "linux", "no GPU is visible"), ("two", 2, "linux", "not a number"),
    ("0", 2, "linux", "1 or more"), ("2", 2, "win32", "not supported on Windows"),
])
def test_gpu_count_refuses_what_cannot_run(value, visible, platform, match):
    with pytest.raises(ConfigError, match=match):
        gpu_count(value, visible, platform=platform)


def test_the_ranks_run_unsloth_train_without_gpus():
    command = torchrun_command(2, ["cfg.toml", "--set=training.max_steps=3"], python="py")
    assert command[:3] == ["py", "-m", "torch.distributed.run"] and "--nproc-per-node=2" in command
    assert command[-5:] == ["-m", "unsloth.cli", "train", "cfg.toml", "--set=training.max_steps=3"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return write_tiny_model(root / "model"), write_dataset(root / "data.jsonl")


def _config(tiny, tmp_path, max_steps: int) -> Path:
    model, data = tiny
    path = tmp_path / "train.toml"
    path.write_text(f"""
output_dir = "{tmp_path / 'out'}"
save_merged = true
[model]
name = "{model}"
max_seq_length = 32
dtype = "float32"
[dataset]
name = "{data}"
[lora]
r = 4
[training]
max_steps = {max_steps}
per_device_train_batch_size = 2
gradient_accumulation_steps = 1
save_strategy = "no"
""")
    return path


def _start(config: Path, tmp_path: Path, hooks: Path | None = None) -> subprocess.Popen:
    paths = [str(hooks)] if hooks else []
    env = {**os.environ, "UNSLOTH_DISTRIBUTED_CPU": "1",
           "PYTHONPATH": os.pathsep.join(paths + [p for p in sys.path if p])}
    return subprocess.Popen([sys.executable, "-m", "unsloth.cli", "train", str(config), "--gpus", "2"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_train_on_two_processes_end_to_end(tiny, tmp_path):
    job = _start(_config(tiny, tmp_path, max_steps=2), tmp_path)
    out, err = job.communicate(timeout=600)
    assert job.returncode == 0, err[-4000:]
    assert out.count("done: adapters in") == 1  # rank 0 alone reports
    assert (out + err).count("step 2/2") == 1
    output = tmp_path / "out"
    assert (output / "lora" / "adapter_model.safetensors").is_file()
    assert (output / "merged" / "model.safetensors").is_file()
    logged = [json.loads(line) for line in (output / "loss_log.jsonl").read_text().splitlines()]
    logged = [record for record in logged if "loss" in record]
    assert [record["step"] for record in logged] == [1, 2]
    # Data parallel: a step is 2 ranks x 2 rows of the 24-row dataset, not one process's 2.
    assert logged[0]["epoch"] == pytest.approx(4 / 24)


def _hooks(tmp_path: Path, body: str) -> Path:
    """A sitecustomize for the ranks: `body` runs in rank 1 (or all ranks) as Python starts."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(body)
    return hooks


@pytest.mark.slow
def test_a_failing_rank_stops_the_job_with_its_message(tiny, tmp_path):
    marker = tmp_path / "failed_at"
    hooks = _hooks(tmp_path, f"""
import os, time
if os.environ.get("RANK") == "1":
    import torch.optim

    def broken(self, *args, **kwargs):
        open({str(marker)!r}, "w").write(repr(time.time()))
        raise RuntimeError("rank 1 lost its optimizer step")

    torch.optim.AdamW.step = broken
""")
    job = _start(_config(tiny, tmp_path, max_steps=50), tmp_path, hooks)
    out, err = job.communicate(timeout=600)
    ended = time.time()
    assert job.returncode != 0
    assert "rank 1 lost its optimizer step" in err
    assert ended - float(marker.read_text()) < 30  # rank 0, waiting in a collective, was stopped, not left


@pytest.mark.slow
def test_sigterm_stops_every_rank(tiny, tmp_path):
    import psutil

    job = _start(_config(tiny, tmp_path, max_steps=10_000), tmp_path)
    log = tmp_path / "out" / "loss_log.jsonl"
    deadline = time.time() + 600
    while not (log.is_file() and log.read_text().strip()):  # the marker: training is under way
        assert job.poll() is None, job.stderr.read()[-4000:]
        assert time.time() < deadline
        time.sleep(0.2)
    ranks = psutil.Process(job.pid).children(recursive=True)
    assert len([p for p in ranks if "unsloth.cli" in " ".join(p.cmdline())]) >= 2
    job.send_signal(signal.SIGTERM)
    job.communicate(timeout=60)
    gone, alive = psutil.wait_procs(ranks, timeout=30)
    assert not alive and job.returncode != 0
