"""Probe outputs are read up to a size limit and parsed in linear time; text no parser recognises
gives unknown facts, never GPUs (issue #22: 200 KB of random bytes once gave 677 phantom GPUs)."""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unsloth.platform.detect import MAX_GPUS_PER_PROBE, detect, detect_from_dump
from unsloth.platform.dump import MAX_PROBE_BYTES, decode, read_dump
from unsloth.platform.facts import ProbeResult
from unsloth.platform.parsers import _registry

PARSERS = sorted(_registry().items())


def _random_bytes(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


def test_random_bytes_in_nvidia_smi_txt_are_no_gpus(tmp_path):
    (tmp_path / "nvidia-smi.txt").write_bytes(_random_bytes(200_000))
    platform, _ = detect_from_dump(tmp_path)
    assert platform.gpus == []
    assert (platform.os, platform.nvidia_driver, platform.cuda_driver) == (None, None, None)


@pytest.mark.parametrize("megabytes", [1, pytest.param(50, marks=pytest.mark.slow)])
def test_huge_garbage_files_are_read_only_up_to_the_limit(tmp_path, megabytes):
    (tmp_path / "nvidia-smi.txt").write_bytes(_random_bytes(megabytes * 2**20, seed=megabytes))
    for name in ("rocminfo", "lspci"):  # beside it, garbage just past the limit
        (tmp_path / f"{name}.txt").write_bytes(_random_bytes(MAX_PROBE_BYTES + 1, seed=megabytes))
    results = read_dump(tmp_path)
    assert all(len(r.text) <= MAX_PROBE_BYTES for r in results.values())
    assert "only the first" in results["rocminfo"].detail
    if megabytes * 2**20 > MAX_PROBE_BYTES:
        assert "only the first" in results["nvidia-smi"].detail
    start = time.monotonic()
    platform, _ = detect_from_dump(tmp_path)
    # Not a speed goal: a guard against the quadratic behaviour that took 136 s on 4 MB.
    assert time.monotonic() - start < 60
    assert platform.gpus == [] and platform.os is None


@pytest.mark.parametrize("name, parse", PARSERS, ids=[name for name, _ in PARSERS])
@settings(max_examples=20, deadline=None)
@given(data=st.binary(min_size=1, max_size=20_000))
def test_no_parser_finds_gpus_in_random_bytes(name, parse, data):
    assert parse(decode(data)).gpus == []


_LONE_WORDS = {"win32-videocontroller": ["rtx", "amd\n", "Radeon", "PS C:\\> x\nIris\n", "NVIDIA\nGeForce\n",
                                         "arc] n\n"],
               "nvidia-smi": ["rtx", "ik-rtx", "NVIDIA\nGeForce\n", "nvidiaTesla\n", "i rtx\n"]}
_REAL_NAMES = {"win32-videocontroller": "AMD Radeon(TM) Graphics", "nvidia-smi": "NVIDIA GeForce RTX 4090"}


@pytest.mark.parametrize("parser, text", [(parser, text) for parser, texts in _LONE_WORDS.items() for text in texts])
def test_a_lone_brand_word_is_no_adapter_name(parser, text):
    """Hypothesis's find: b'rtx' read as `(Get-WmiObject Win32_VideoController).Name` output (and as
    `nvidia-smi --query-gpu=name` output, by the same rule); a real name still is one."""
    assert dict(PARSERS)[parser](text).gpus == []
    assert [g.name for g in dict(PARSERS)[parser](_REAL_NAMES[parser] + "\n").gpus] == [_REAL_NAMES[parser]]


def test_headerless_csv_needs_an_nvidia_name_or_id():
    parse = dict(PARSERS)["nvidia-smi"]
    assert parse("hello, world\nfoo, 12, bar\n").gpus == []
    assert parse("Some Product, 8192 MiB\n").gpus == []  # no NVIDIA name, no id: not nvidia-smi
    assert [g.name for g in parse("NVIDIA A10, 23028 MiB\n").gpus] == ["NVIDIA A10"]
    assert [g.name for g in parse("TITAN Xp, 12196 MiB\n").gpus] == ["TITAN Xp"]  # older drivers' names


def test_more_gpus_than_a_machine_holds_are_dropped_with_a_note():
    rows = "\n".join(f"{i}, NVIDIA A100, 0000:{i % 256:02x}:00.0" for i in range(MAX_GPUS_PER_PROBE + 1))
    platform = detect({"nvidia-smi": ProbeResult("nvidia-smi", "ok", rows)})
    assert platform.gpus == []
    assert any("no real machine" in note for note in platform.notes)


def test_markdown_quoted_output_reads_as_the_output():
    table = (
        "> | NVIDIA-SMI 550.54.14    Driver Version: 550.54.14    CUDA Version: 12.4 |\n"
        "> | GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |\n"
        "> |   0  NVIDIA GeForce RTX 4090        Off |   00000000:01:00.0  On |                  Off |\n"
        "> |  0%   45C    P8             30W /  450W |     812MiB /  24564MiB |      0%      Default |\n"
    )
    platform = detect({"nvidia-smi": ProbeResult("nvidia-smi", "ok", "```\n" + table + "```\n")})
    assert [(g.name, g.arch) for g in platform.gpus] == [("NVIDIA GeForce RTX 4090", "sm_89")]
    assert platform.os == "linux"
