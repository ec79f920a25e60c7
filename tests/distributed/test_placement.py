"""Where a rank runs: the CPUs on its GPU's NUMA node (sysfs), so its pinned offload buffers land there."""

from __future__ import annotations

import os
from types import SimpleNamespace

import psutil
import pytest
import torch

from unsloth.models import distributed


def test_linux_cpu_lists_read_as_numbers():
    assert distributed.parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert distributed.parse_cpulist("5") == [5]


def test_the_gpus_numa_cpus_come_from_its_pci_address(tmp_path, monkeypatch):
    (tmp_path / "0000:41:00.0").mkdir()
    (tmp_path / "0000:41:00.0" / "local_cpulist").write_text("16-19\n")
    props = SimpleNamespace(pci_domain_id=0, pci_bus_id=0x41, pci_device_id=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    assert distributed.gpu_local_cpus(0, sysfs=tmp_path) == [16, 17, 18, 19]
    assert distributed.gpu_local_cpus(0, sysfs=tmp_path / "elsewhere") == []  # cannot tell: unchanged


class FakeProcess:
    def __init__(self, allowed):
        self.allowed = list(allowed)

    def cpu_affinity(self, cpus=None):
        if cpus is None:
            return self.allowed
        self.allowed = list(cpus)


@pytest.mark.parametrize("world, numa, allowed, chosen", [
    ("2", [4, 5, 6, 7, 12], range(8), [4, 5, 6, 7]),  # the node's CPUs this process may use
    ("1", [4, 5, 6, 7], range(8), []),  # one process: left alone
    ("2", [], range(8), []),  # the node unknown
    ("2", [20, 21], range(8), []),  # none of the node's CPUs allowed: left alone rather than pinned to nothing
    ("2", [0, 1, 2, 3], range(4), []),  # already there
])
def test_a_rank_binds_to_its_gpus_numa_node_only_when_it_helps(monkeypatch, world, numa, allowed, chosen):
    process = FakeProcess(allowed)
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setattr(distributed, "gpu_local_cpus", lambda index: numa)
    monkeypatch.setattr(psutil, "Process", lambda: process)
    assert distributed.bind_to_gpu_numa_node(0) == chosen
    assert process.allowed == (chosen or list(allowed))


_EXIT_PROBE = """
import atexit, sys, tempfile
import torch.distributed as dist
from unsloth.models import distributed
atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))  # runs after ours
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
dist.all_reduce(__import__("torch").ones(3))
if sys.argv[1] == "hook":
    distributed.destroy_process_group_at_exit()
    distributed.destroy_process_group_at_exit()  # a second call (a second model loaded) is harmless
if sys.argv[1] == "destroyed":
    distributed.destroy_process_group_at_exit()
    dist.destroy_process_group()  # the script's own: the hook has nothing left to do
"""


@pytest.mark.parametrize("case, left", [("hook", False), ("none", True), ("destroyed", False)])
def test_the_process_group_is_destroyed_before_the_interpreter_exits(case, left):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _EXIT_PROBE, case], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"initialized at exit: {left}" in done.stdout and "failed" not in done.stderr, done.stderr[-2000:]


def test_an_nccl_group_is_left_to_pytorch_at_exit(monkeypatch):
    """After an interrupt NCCL's shutdown could wait on a collective the other ranks never finish."""
    import torch.distributed as dist

    destroyed = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: destroyed.append(dist.get_backend()))
    for backend in ("nccl", "gloo"):
        monkeypatch.setattr(dist, "get_backend", lambda backend=backend: backend)
        distributed._destroy_process_group()
    assert destroyed == ["gloo"]
