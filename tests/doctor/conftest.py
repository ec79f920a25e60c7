"""Builders for the doctor tests: a Plan and HostFacts as the real code would produce them."""

from __future__ import annotations

import pytest

from unsloth.doctor.host import DeviceNode, HostFacts
from unsloth.platform.facts import Gpu
from unsloth.plan import BitsAndBytes, LlamaCpp, Plan, TorchChoice

GIB = 2**30

_RTX_4090 = dict(vendor="nvidia", name="NVIDIA GeForce RTX 4090", arch="sm_89", family="Ada",
                 vram_bytes=24 * GIB, integrated=False, pci_id="10de:2684", compute_capability="8.9",
                 sources=["nvidia-smi"])
_RX_7800 = dict(vendor="amd", name="AMD Radeon RX 7800 XT", arch="gfx1101", family="RDNA3", vram_bytes=16 * GIB,
                integrated=False, pci_id="1002:747e", sources=["rocminfo", "kfd-topology"])


@pytest.fixture
def rtx4090() -> Gpu:
    return Gpu(**_RTX_4090)


@pytest.fixture
def rx7800() -> Gpu:
    return Gpu(**_RX_7800)


@pytest.fixture
def make_plan():
    def build(backend: str = "cpu", variant: str | None = None, device: Gpu | None = None, **fields) -> Plan:
        values = dict(
            support="full" if device else "limited",
            reason="tested path" if device else "no usable GPU",
            device=device,
            device_reason="best supported GPU" if device else "no GPU found",
            torch=TorchChoice(backend=backend, variant=variant or backend, index_url=None),
            bitsandbytes=BitsAndBytes("pypi" if device else "none"),
            llama_cpp=LlamaCpp({"cuda": "cuda", "rocm": "hip"}.get(backend, "cpu")),
            attention="sdpa",
            env={},
        )
        values.update(fields)
        return Plan(**values)

    return build


@pytest.fixture
def make_host():
    def build(**fields) -> HostFacts:
        values = dict(user="ada", groups=["ada", "render", "video"], member_of=["render", "video"],
                      kfd=DeviceNode("/dev/kfd", True, "render"),
                      render_nodes=[DeviceNode("/dev/dri/renderD128", True, "render")],
                      wsl_lib_dir=False, data_dir="/home/ada/.local/share/unsloth", disk_free_bytes=100 * GIB)
        values.update(fields)
        return HostFacts(**values)

    return build
