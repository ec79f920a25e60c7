"""Data parallel (DDP) and sharded (FSDP2) training on 2 gloo processes equal one process on the same
global batch: the step losses and the first step's gradients of the trainable weights."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiny_run import single_process_run
from tiny_setup import write_tiny_model

HERE = Path(__file__).resolve().parent
# float32 everywhere; what differs is the order of the sums (rows split over ranks, gradients
# averaged by the collective), which moves the results by ~1e-6 relative.
TOLERANCE = dict(rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


def torchrun(*args, nprocs: int = 2, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path]), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nprocs),
               "--master-port", "0", "--standalone", *map(str, args)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


def distributed_run(tmp_path, strategy, kind, model_dir) -> dict:
    out = tmp_path / "result.pt"
    done = torchrun(HERE / "tiny_run.py", strategy, kind, model_dir, out)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out)


def assert_same_run(got: dict, want: dict) -> None:
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), **TOLERANCE)
    assert got["grads"].keys() == want["grads"].keys()
    for name, grad in want["grads"].items():
        assert grad.abs().max() > 0, name  # a weight without a gradient would compare equal trivially
        torch.testing.assert_close(got["grads"][name], grad, msg=name, **TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize("strategy, kind", [("ddp", "lora"), ("ddp", "qlora")])
def test_data_parallel_equals_one_process(tmp_path, model_dir, strategy, kind):
    assert_same_run(distributed_run(tmp_path, strategy, kind, model_dir), single_process_run(model_dir, kind))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lora", "qlora", "full"])
def test_fsdp2_sharded_training_equals_one_process(tmp_path, model_dir, kind):
    """FSDP2 over our patched model: LoRA on a sharded 16-bit base, on a sharded NF4 base (its packed
    bytes stored in the compute dtype), and full fine-tuning."""
    assert_same_run(distributed_run(tmp_path, "fsdp", kind, model_dir), single_process_run(model_dir, kind))


@pytest.mark.slow
def test_fsdp2_resumes_from_a_sharded_checkpoint_and_saves_merged_weights(tmp_path, model_dir):
    """Step 1 in one job, which saves a sharded checkpoint; steps 2-3 in a second job resumed from it:
    the same losses as one process running all three; the merged save gathers the shards into the
    weights one process writes."""
    from safetensors.torch import load_file

    checkpoint, merged = tmp_path / "checkpoint", tmp_path / "merged"
    first = torchrun(HERE / "tiny_run.py", "fsdp", "lora", model_dir, tmp_path / "first.pt", "stop=1",
                     f"checkpoint={checkpoint}")
    assert first.returncode == 0, first.stderr[-4000:]
    assert len(list(checkpoint.glob("*.distcp"))) == 2  # one shard file per rank
    second = torchrun(HERE / "tiny_run.py", "fsdp", "lora", model_dir, tmp_path / "second.pt", "start=1",
                      f"resume={checkpoint}", f"merged={merged}")
    assert second.returncode == 0, second.stderr[-4000:]
    want = single_process_run(model_dir, "lora", merged_dir=str(tmp_path / "want"))
    losses = torch.load(tmp_path / "first.pt")["losses"] + torch.load(tmp_path / "second.pt")["losses"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want["losses"]), **TOLERANCE)
    got, expected = load_file(merged / "model.safetensors"), load_file(tmp_path / "want" / "model.safetensors")
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, msg=name, **TOLERANCE)
