"""`unsloth train CONFIG --gpus N`: torchrun started for the user, rank 0 alone reporting, a failing
rank stopping the job with its message, a SIGTERM stopping every rank. On the CPU the ranks are
gloo processes (UNSLOTH_DISTRIBUTED_CPU=1)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

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


def _config(tiny, tmp_path, max_steps: int, name: str = "out", top: str = "", model_lines: str = "",
            saves: str = 'save_strategy = "no"', accumulation: int = 1) -> Path:
    model, data = tiny
    path = tmp_path / f"{name}.toml"
    path.write_text(f"""
output_dir = "{tmp_path / name}"
save_merged = true
{top}
[model]
name = "{model}"
max_seq_length = 32
dtype = "float32"
{model_lines}
[dataset]
name = "{data}"
[lora]
r = 4
[training]
max_steps = {max_steps}
per_device_train_batch_size = 2
gradient_accumulation_steps = {accumulation}
{saves}
""")
    return path


def _start(config: Path, tmp_path: Path, hooks: Path | None = None, flags=(), preexec=None) -> subprocess.Popen:
    paths = [str(hooks)] if hooks else []
    env = {**os.environ, "UNSLOTH_DISTRIBUTED_CPU": "1",
           "PYTHONPATH": os.pathsep.join(paths + [p for p in sys.path if p])}
    return subprocess.Popen([sys.executable, "-m", "unsloth.cli", "train", str(config), "--gpus", "2", *flags],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=preexec)


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


def _run(config: Path, tmp_path: Path, *flags: str) -> tuple[str, str]:
    job = _start(config, tmp_path, flags=flags)
    out, err = job.communicate(timeout=900)
    assert job.returncode == 0, err[-4000:]
    return out, err


def _losses(output: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (output / "loss_log.jsonl").read_text().splitlines()]
    return {record["step"]: record["loss"] for record in records if "loss" in record}


def _sharded_checkpoint(folder: Path) -> bool:
    return (folder / "sharded" / ".metadata").is_file() and len(list((folder / "sharded").glob("*.distcp"))) == 2


@pytest.mark.slow
def test_fsdp_trains_as_ddp_does_checkpoints_sharded_and_resumes(tiny, tmp_path):
    """`distributed = "fsdp"`: the same losses and adapters as DDP on the same global batches; sharded
    checkpoints (one shard file per rank) that `--resume` continues from with the uninterrupted losses;
    adapters and merged weights gathered from the shards (merged = base + scale * B @ A)."""
    from safetensors.torch import load_file

    saves = 'save_strategy = "steps"\nsave_steps = 1'
    fsdp_run = dict(max_steps=2, top='distributed = "fsdp"', saves=saves, accumulation=2)  # reduced once per step
    _run(_config(tiny, tmp_path, max_steps=2, name="ddp", accumulation=2), tmp_path)
    out, _ = _run(_config(tiny, tmp_path, name="fsdp", **fsdp_run), tmp_path)
    fsdp = tmp_path / "fsdp"
    assert out.count("done: adapters in") == 1  # rank 0 alone reports
    assert _sharded_checkpoint(fsdp / "checkpoint-1") and _sharded_checkpoint(fsdp / "checkpoint-2")
    want, got = _losses(tmp_path / "ddp"), _losses(fsdp)
    assert list(got) == [1, 2]
    torch.testing.assert_close(torch.tensor([*got.values()]), torch.tensor([*want.values()]), rtol=1e-4, atol=1e-6)
    adapters = load_file(fsdp / "lora" / "adapter_model.safetensors")
    ddp_adapters = load_file(tmp_path / "ddp" / "lora" / "adapter_model.safetensors")
    assert adapters.keys() == ddp_adapters.keys() and len(adapters) == 2 * 7 * 2  # A and B, 7 targets, 2 layers
    for name, tensor in ddp_adapters.items():
        torch.testing.assert_close(adapters[name], tensor, rtol=1e-4, atol=1e-6, msg=name)

    base, merged = load_file(Path(tiny[0]) / "model.safetensors"), load_file(fsdp / "merged" / "model.safetensors")
    scale = 16 / 4  # lora.alpha (default) / lora.r
    for name in [k for k in adapters if ".lora_A." in k]:
        weight = name.removeprefix("base_model.model.").replace(".lora_A", "")
        b = adapters[name.replace(".lora_A.", ".lora_B.")]
        torch.testing.assert_close(merged[weight], base[weight] + scale * b @ adapters[name], rtol=1e-4, atol=1e-5)

    # A run stopped after step 1, resumed from its sharded checkpoint: step 2 as uninterrupted.
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(fsdp / "checkpoint-1", resumed / "checkpoint-1")
    config = _config(tiny, tmp_path, name="resumed", **fsdp_run)
    out, err = _run(config, tmp_path, "--resume")
    assert f"resuming from {resumed / 'checkpoint-1'}" in out + err
    assert list(_losses(resumed)) == [2]
    assert _losses(resumed)[2] == pytest.approx(got[2], rel=1e-5)
    for name, tensor in load_file(resumed / "lora" / "adapter_model.safetensors").items():
        torch.testing.assert_close(tensor, adapters[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("kind, model_lines", [("qlora", "load_in_4bit = true"), ("full", "full_finetuning = true")])
def test_fsdp_shards_qlora_and_full_finetuning(tiny, tmp_path, kind, model_lines):
    """A 4-bit base (its packed bytes stored in the compute dtype) and full fine-tuning shard too: a sharded
    checkpoint, and the final save gathered from the shards."""
    from safetensors.torch import load_file

    config = _config(tiny, tmp_path, max_steps=1, name=kind, top='distributed = "fsdp"', model_lines=model_lines,
                     saves='save_strategy = "steps"\nsave_steps = 1')
    _run(config, tmp_path)
    output = tmp_path / kind
    assert _sharded_checkpoint(output / "checkpoint-1") and list(_losses(output)) == [1]
    base = load_file(Path(tiny[0]) / "model.safetensors")
    saved = load_file(output / ("model.safetensors" if kind == "full" else "merged/model.safetensors"))
    assert {name: t.shape for name, t in saved.items()} == {name: t.shape for name, t in base.items()}
    changed = [name for name in base if not torch.equal(saved[name].float(), base[name])]
    if kind == "full":  # every weight trained
        assert len(changed) == len(base)
    else:  # 4-bit: each LoRA target merged from its NF4 base (as the loader quantized it) + scale * B @ A
        import bitsandbytes.functional as bnb

        adapters = load_file(output / "lora" / "adapter_model.safetensors")
        targets = [k for k in adapters if ".lora_A." in k]
        assert len(targets) == 7 * 2
        for name in targets:
            weight = name.removeprefix("base_model.model.").replace(".lora_A", "")
            packed, state = bnb.quantize_4bit(base[weight], blocksize=64, compress_statistics=True, quant_type="nf4")
            delta = 16 / 4 * adapters[name.replace(".lora_A.", ".lora_B.")].float() @ adapters[name].float()
            torch.testing.assert_close(saved[weight].float(), bnb.dequantize_4bit(packed, state) + delta,
                                       rtol=1e-5, atol=1e-6, msg=weight)


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
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_and_ctrl_c_stop_every_rank(tiny, tmp_path, signum):
    import psutil

    # SIGINT as Ctrl-C sends it, to a launcher that does not ignore it (a `&` job's children would).
    job = _start(_config(tiny, tmp_path, max_steps=10_000), tmp_path,
                 preexec=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    log = tmp_path / "out" / "loss_log.jsonl"
    deadline = time.time() + 600
    while not (log.is_file() and log.read_text().strip()):  # the marker: training is under way
        assert job.poll() is None, job.stderr.read()[-4000:]
        assert time.time() < deadline
        time.sleep(0.2)
    ranks = psutil.Process(job.pid).children(recursive=True)
    assert len([p for p in ranks if "unsloth.cli" in " ".join(p.cmdline())]) >= 2
    job.send_signal(signum)
    job.communicate(timeout=60)
    gone, alive = psutil.wait_procs(ranks, timeout=30)
    assert not alive and job.returncode != 0


@pytest.mark.slow
def test_a_notebook_script_under_accelerate_launch_and_torchrun(tiny, tmp_path):
    """The issue's first failure (a notebook's LoRA SFT with our offloaded checkpointing, started on 2
    processes, stopped in DDP's first backward) runs under `accelerate launch`; under `torchrun`, the
    FSDP2 trainer class gives the same losses and adapters."""
    from safetensors.torch import load_file

    model, data = tiny
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    script = Path(__file__).resolve().parent / "notebook_sft.py"
    launchers = {"ddp": ["accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                         "--mixed_precision", "no", "--dynamo_backend", "no"],
                 "fsdp": ["torch.distributed.run", "--standalone", "--nproc-per-node", "2"]}
    for strategy, launcher in launchers.items():
        done = subprocess.run([sys.executable, "-m", *launcher, str(script), strategy, model, data,
                               str(tmp_path / strategy)], env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-4000:]
    ddp, fsdp = (json.loads((tmp_path / s / "losses.json").read_text()) for s in ("ddp", "fsdp"))
    assert len(ddp) == 2
    torch.testing.assert_close(torch.tensor(fsdp), torch.tensor(ddp), rtol=1e-4, atol=1e-6)
    want = load_file(tmp_path / "ddp" / "lora" / "adapter_model.safetensors")
    got = load_file(tmp_path / "fsdp" / "lora" / "adapter_model.safetensors")
    assert got.keys() == want.keys() and want
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-4, atol=1e-6, msg=name)
