"""docs/hardware-support.md is generated from the matrix and must match it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from unsloth.matrix_docs import channel, render

DOC = Path(__file__).resolve().parents[2] / "docs" / "hardware-support.md"


def test_committed_doc_matches_the_matrix(matrix):
    assert DOC.read_text(encoding="utf-8") == render(matrix), (
        "docs/hardware-support.md is stale: run `python -m unsloth.matrix_docs > docs/hardware-support.md`"
    )


def test_doc_follows_a_matrix_change(matrix):
    cell = matrix.cell("Pascal", "linux")
    changed = dataclasses.replace(
        matrix, support={**matrix.support, ("Pascal", "linux"): dataclasses.replace(cell, level="full")}
    )
    row = next(line for line in render(changed).splitlines() if line.startswith("| Pascal |"))
    assert row.split(" | ")[4] == "**full** · cu126 (by driver)"


def test_channels(matrix):
    families = matrix.families
    assert channel(matrix, families["Blackwell"], "linux") == "cu130 / cu128 (by driver)"
    assert channel(matrix, families["RDNA2"], "windows") == "CPU"
    assert channel(matrix, families["RDNA4"], "windows") == "AMD wheels `gfx120X-all`"
    assert channel(matrix, families["RDNA3"], "linux") == "rocm7.2 / rocm7.1 / rocm6.4; override for gfx1103"
    assert channel(matrix, families["Apple"], "macos") == "PyPI (MPS)"
