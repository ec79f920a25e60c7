"""`unsloth train CONFIG --gpus N`: the same training, one process per GPU, started through torchrun.

We start PyTorch's own launcher (torch.distributed.run) on `unsloth train CONFIG` without --gpus;
every rank then trains as one process would and the Trainer (accelerate) sees the job and wraps
the model in DDP. torchrun also gives the rest: when a rank fails, it stops the others at once
(their errors are printed as they come, rank 0 prints progress and logs alone), and a SIGTERM or
SIGINT sent to us is passed on to it, which stops every rank.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from unsloth.training.config import ConfigError

# Tests (and machines without GPUs) may run the ranks as CPU processes talking over gloo.
CPU_PROCESSES_ENV = "UNSLOTH_DISTRIBUTED_CPU"


def gpu_count(value: str, visible: int, platform: str = sys.platform, cpu_processes: bool = False) -> int:
    """How many processes `--gpus VALUE` asks for, with `visible` GPUs on this machine."""
    if platform == "win32":
        raise ConfigError("--gpus: training on several GPUs is not supported on Windows (PyTorch has no NCCL "
                          "there); train on one GPU without --gpus, or use WSL or Linux")
    if value == "all":
        if cpu_processes:
            raise ConfigError(f"--gpus all: {CPU_PROCESSES_ENV} runs CPU processes; give their number")
        count = visible
    else:
        try:
            count = int(value)
        except ValueError:
            raise ConfigError(f"--gpus: {value!r} is not a number of GPUs; give one (--gpus 2) or all") from None
    if count < 1:
        raise ConfigError("--gpus: no GPU is visible here" if value == "all" else "--gpus: must be 1 or more")
    if not cpu_processes and count > visible:
        raise ConfigError(f"--gpus {value}: only {visible} GPU(s) visible (CUDA_VISIBLE_DEVICES and "
                          "`unsloth doctor` show which); ask for at most that many")
    return count


def torchrun_command(processes: int, train_args: list[str], python: str = sys.executable) -> list[str]:
    """The torchrun command that runs `unsloth train TRAIN_ARGS` in `processes` ranks on this host."""
    return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
            "-m", "unsloth.cli", "train", *train_args]


def rank_environment(cpu_processes: bool) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1" if cpu_processes else env.get("OMP_NUM_THREADS", "4"))
    if cpu_processes:  # the Trainer (accelerate) then runs the ranks as CPU processes over gloo
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["ACCELERATE_USE_CPU"] = "true"
    return env


def launch(processes: int, train_args: list[str], cpu_processes: bool = False) -> int:
    """Run the job to its end; returns torchrun's exit code (a rank's, when one failed)."""
    process = subprocess.Popen(torchrun_command(processes, train_args), env=rank_environment(cpu_processes))

    def pass_on(signum, _frame):
        process.send_signal(signal.SIGTERM)  # torchrun then stops every rank

    previous = {s: signal.signal(s, pass_on) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return process.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
