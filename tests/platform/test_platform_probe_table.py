"""The probe table: each probe declared once, and detection's orders derived from it are well defined."""

from __future__ import annotations

from collections import Counter
from dataclasses import fields

import pytest

from unsloth.platform import detect
from unsloth.platform.facts import Gpu, Platform, ProbeResult
from unsloth.platform.parsers import parser_for
from unsloth.platform.probes import (
    FACT_SOURCES,
    GPU_SOURCES,
    PROBES,
    REAL_ARCH_SOURCES,
    ROCM_PROBES,
    ROCM_VERSION_SOURCES,
    sources_of,
)

PLATFORM_FIELDS = {f.name for f in fields(Platform)}


def test_names_are_unique_and_each_probe_runs_or_reads_one_thing():
    assert not [name for name, n in Counter(p.name for p in PROBES).items() if n > 1]
    assert all(bool(p.command) != (p.read is not None) for p in PROBES)


@pytest.mark.parametrize("probe", PROBES, ids=lambda p: p.name)
def test_what_a_row_claims_its_parser_can_say(probe):
    assert parser_for(probe.name) is probe.parser
    assert set(probe.facts) <= PLATFORM_FIELDS, "a fact that is no Platform field"
    if probe.facts or probe.gpus or probe.real_arch:
        assert probe.parser is not None, "speaks to facts but nothing reads its text"


def test_priorities_never_tie():
    """Two probes with one priority for a fact would make 'the first that states it' depend on the table's order."""
    for fact in {fact for p in PROBES for fact in p.facts}:
        ranks = [p.facts[fact] for p in PROBES if fact in p.facts]
        assert len(ranks) == len(set(ranks)), fact
    for rank in ("gpus", "real_arch"):
        ranks = [getattr(p, rank) for p in PROBES if getattr(p, rank) is not None]
        assert len(ranks) == len(set(ranks)), rank


def test_detection_uses_the_derived_orders():
    assert (detect.GPU_SOURCES, detect.REAL_ARCH_SOURCES, detect.FACT_SOURCES) == (GPU_SOURCES, REAL_ARCH_SOURCES, FACT_SOURCES)
    assert GPU_SOURCES[:2] == ("nvidia-smi-query", "nvidia-smi")  # the csv query is the most detailed listing
    assert REAL_ARCH_SOURCES[0] == "kfd-topology"  # sysfs, which no HSA override changes
    assert set(REAL_ARCH_SOURCES) <= set(GPU_SOURCES) and "rocminfo" not in REAL_ARCH_SOURCES
    assert "rocm_version" not in FACT_SOURCES and ROCM_VERSION_SOURCES == sources_of("rocm_version")
    assert list(FACT_SOURCES) == [f for f in (f.name for f in fields(Platform)) if f in FACT_SOURCES]
    assert set(ROCM_VERSION_SOURCES) <= set(ROCM_PROBES) and "kfd-topology" not in ROCM_PROBES


def test_a_higher_priority_probe_wins_a_fact():
    """nvidia-smi's query (priority 1 for the driver) over the module file (3), whatever order the results come in."""
    results = {
        "sys-module-nvidia-version": ProbeResult("sys-module-nvidia-version", "ok", "535.1.1\n"),
        "nvidia-smi-query": ProbeResult("nvidia-smi-query", "ok", "0, NVIDIA A100-SXM4-80GB, 00000000:07:00.0, 0x20B210DE, "
                                        "81920, 8.0, 550.54.15, GPU-1\n"),
    }
    platform = detect.detect(results)
    assert (platform.nvidia_driver, platform.provenance["nvidia_driver"]) == ("550.54.15", "nvidia-smi-query")
    assert platform.gpus and isinstance(platform.gpus[0], Gpu)


def test_rocm_installed_is_a_fact_from_the_probes_that_show_rocm():
    assert detect.detect({"lspci": ProbeResult("lspci", "ok", "")}).rocm_installed is None  # no ROCm probe ran
    absent = detect.detect({"rocminfo": ProbeResult("rocminfo", "absent"), "hipconfig": ProbeResult("hipconfig", "failed")})
    assert absent.rocm_installed is False and "rocm_installed" not in absent.provenance
    # rocm-smi answered, though it says no version: ROCm is there
    seen = detect.detect({"rocminfo": ProbeResult("rocminfo", "absent"), "rocm-smi": ProbeResult("rocm-smi", "ok", "")})
    assert (seen.rocm_installed, seen.provenance["rocm_installed"], seen.rocm_version) == (True, "rocm-smi", None)
    assert detect.detect({"kfd-topology": ProbeResult("kfd-topology", "ok", "")}).rocm_installed is None  # the kernel side
