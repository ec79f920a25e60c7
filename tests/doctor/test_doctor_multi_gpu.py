"""`unsloth doctor` with several GPUs: their links parsed from nvidia-smi / rocm-smi topology output
(the fixtures follow those tools' printed format), judged for multi-GPU training."""

from __future__ import annotations

from pathlib import Path

import pytest

from unsloth.doctor.checks import check_multi_gpu
from unsloth.doctor.host import HostFacts
from unsloth.platform.facts import Gpu, Platform
from unsloth.platform.parsers.gpu_topology import parse_nvidia_topo, parse_rocm_topo

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "topology"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_nvlink_matrix_of_four_gpus():
    topology = parse_nvidia_topo(fixture("nvidia-smi-topo__4x-h200-nvlink.txt"))
    assert topology.gpus == 4  # the NIC row and column are not GPUs
    assert set(topology.links) == {(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)}
    assert set(topology.links.values()) == {"nvlink"}
    assert topology.numa_nodes == {0: "0", 1: "0", 2: "1", 3: "1"}


def test_pcie_across_sockets_is_the_slowest_link():
    topology = parse_nvidia_topo(fixture("nvidia-smi-topo__2x-rtx4090-pcie.txt"))
    assert topology.links == {(0, 1): "pcie-sockets"} and topology.slowest() == "pcie-sockets"


def test_rocm_link_types():
    topology = parse_rocm_topo(fixture("rocm-smi-showtopo__2x-mi300x.txt"))
    assert topology.gpus == 2 and topology.links == {(0, 1): "xgmi"}


@pytest.mark.parametrize("text", ["", "No devices were found", "GPU0\tGPU1\n", fixture("rocm-smi-showtopo__2x-mi300x.txt")])
def test_text_without_an_nvidia_matrix_gives_none(text):
    assert parse_nvidia_topo(text) is None


def _platform(count: int, os: str = "linux") -> Platform:
    return Platform(os=os, gpus=[Gpu(vendor="nvidia", name="NVIDIA H200", integrated=False) for _ in range(count)])


def _host(topology: str | None) -> HostFacts:
    return HostFacts(user="me", gpu_topology=topology)


def test_one_gpu_has_no_multi_gpu_finding():
    assert check_multi_gpu(_platform(1), _host(None)) is None


def test_nvlinked_gpus_are_ready_for_gpus_n():
    finding = check_multi_gpu(_platform(4), _host(fixture("nvidia-smi-topo__4x-h200-nvlink.txt")))
    assert finding.status == "ok" and "NVLink" in finding.message and "--gpus 4" in finding.message


def test_gpus_across_sockets_get_a_warning_and_a_fix():
    finding = check_multi_gpu(_platform(2), _host(fixture("nvidia-smi-topo__2x-rtx4090-pcie.txt")))
    assert finding.status == "warning" and "CPU sockets" in finding.message
    assert "CUDA_VISIBLE_DEVICES" in finding.fix


def test_windows_says_multi_gpu_is_unsupported():
    finding = check_multi_gpu(_platform(2, os="windows"), _host(None))
    assert finding.status == "warning" and "not supported on Windows" in finding.message


def test_unknown_links_still_name_the_gpus():
    finding = check_multi_gpu(_platform(2), _host(None))
    assert finding.status == "ok" and "unknown" in finding.message
