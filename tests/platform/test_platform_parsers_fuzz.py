"""Property tests: no parser, and not detect, raises on any text; garbage yields unknown."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unsloth.platform.detect import detect
from unsloth.platform.facts import ProbeResult
from unsloth.platform.parsers import _registry

DUMPS = Path(__file__).resolve().parent.parent / "fixtures" / "dumps"
PARSERS = sorted(_registry().items())
# Real outputs to cut up: malformed versions of real formats reach deeper than random text.
SAMPLES = sorted({p.read_text(errors="replace") for p in DUMPS.glob("*/*.txt")})
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

tool_like_text = st.lists(
    st.one_of(
        st.text(max_size=80),
        st.sampled_from(
            [
                "GPU[0]\t\t: GFX Version: \tgfx1100",
                "  Name:   gfx90a",
                "  Device Type:  GPU",
                "|   0  NVIDIA GeForce RTX 4090  On | 00000000:01:00.0  On |",
                "Driver Version: 1.2",
                "== x ==",
                "simd_count 4",
                "gfx_target_version 999999",
                "GPU: 0",
                "Name : x",
                "---- ----",
                "{",
                "[",
                "HardwareInformation.qwMemorySize : 0x",
                "Chipset Model:",
                "03:00.0 VGA compatible controller [0300]: x [1002:zzzz]",
                "CUDA Version: ERR!",
            ]
        ),
    ),
    max_size=30,
).map("\n".join)


@pytest.mark.parametrize("name, parse", PARSERS, ids=[name for name, _ in PARSERS])
@FAST
@given(text=tool_like_text)
def test_parser_never_raises_on_arbitrary_text(name, parse, text):
    found = parse(text)
    assert all(gpu.vendor in ("nvidia", "amd", "intel", "apple") for gpu in found.gpus)


@FAST
@given(sample=st.sampled_from(SAMPLES), cuts=st.lists(st.integers(0, 10_000), max_size=6), junk=st.text(max_size=40))
def test_mangled_real_outputs_never_raise_in_any_parser(sample, cuts, junk):
    lines = sample.splitlines()
    for cut in cuts:
        if lines:
            lines.insert(cut % len(lines), junk) if cut % 2 else lines.pop(cut % len(lines))
    text = "\n".join(lines)
    for _, parse in PARSERS:
        parse(text)


@FAST
@given(texts=st.dictionaries(st.sampled_from([n for n, _ in PARSERS]), tool_like_text, max_size=6))
def test_detect_never_raises_and_leaves_no_parser_error(texts):
    platform = detect({name: ProbeResult(name, "ok", text) for name, text in texts.items()})
    platform.to_json()
    assert not [note for note in platform.notes if "could not be read" in note]
