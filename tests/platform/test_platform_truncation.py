"""Bug reports paste outputs cut anywhere: every fixture dump, cut after every line of each of its
files, still detects without error and never invents: no more GPUs than the whole output shows,
and no arch or family the whole output does not give that GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from unsloth.platform.detect import detect
from unsloth.platform.dump import read_dump

DUMPS = sorted(p for p in (Path(__file__).resolve().parents[1] / "fixtures" / "dumps").iterdir() if p.is_dir())


@pytest.mark.parametrize("dump", DUMPS, ids=[p.name for p in DUMPS])
def test_cut_after_any_line_never_invents(dump):
    results = read_dump(dump)
    whole = detect(results)
    for name, result in results.items():
        lines = result.text.splitlines(keepends=True)
        for cut in range(len(lines)):
            text = "".join(lines[:cut])
            cut_results = {**results, name: type(result)(name, result.status, text, result.detail)}
            platform = detect(cut_results)
            where = f"{name} cut after line {cut}"
            assert len(platform.gpus) <= len(whole.gpus), where
            assert not [note for note in platform.notes if "could not be read" in note], where
            for position, gpu in enumerate(platform.gpus):
                full = whole.gpus[position] if position < len(whole.gpus) else None
                if gpu.arch is not None:
                    assert full is not None and gpu.arch == full.arch, (where, position, gpu.arch)
