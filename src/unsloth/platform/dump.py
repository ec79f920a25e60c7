"""Dump directories: one '<probe>.txt' per probe holding the tool's raw output, plus probes.json
with each probe's status and detail, and (from `doctor --dump`) detect.json and plan.json: the
live machine's `detect --json` and plan. See docs/dump-format.md.

A dump may hold any subset of the files; what is missing stays unknown. Files written by hand,
in any of a tool's output forms, and saved with Windows encodings (UTF-16 with BOM from
PowerShell redirection, CRLF) are read too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from unsloth.platform.facts import ProbeResult

INDEX = "probes.json"
# No tool prints more than a few hundred KB about its GPUs (rocminfo on an 8-GPU host, lspci
# -vvv); a bigger file is something else, so only its beginning is read and parsed.
MAX_PROBE_BYTES = 2 * 2**20


def write_dump(directory: str | Path, results: dict[str, ProbeResult]) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    index = {}
    for name, result in sorted(results.items()):
        index[name] = {"status": result.status, "detail": result.detail}
        if result.text:
            (directory / f"{name}.txt").write_text(result.text, encoding="utf-8")
    (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return directory


def write_reports(directory: str | Path, reports: dict[str, Any]) -> None:
    """Beside the raw outputs, what this machine made of them ('detect' -> detect.json, 'plan' ->
    plan.json), so a report shows the answer to reproduce; reading a dump ignores them."""
    for name, data in reports.items():
        (Path(directory) / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def read_dump(directory: str | Path) -> dict[str, ProbeResult]:
    directory = Path(directory)
    if not directory.is_dir():
        raise NotADirectoryError(f"{directory}: not a dump directory (make one with `unsloth doctor --dump DIR`)")
    index: dict[str, dict[str, str]] = {}
    if (directory / INDEX).is_file():
        try:
            loaded = json.loads((directory / INDEX).read_text(encoding="utf-8"))
            index = {k: v for k, v in loaded.items() if isinstance(v, dict)} if isinstance(loaded, dict) else {}
        except ValueError:
            index = {}  # a damaged index loses only the statuses; the outputs still count
    results = {
        name: ProbeResult(name, str(entry.get("status", "ok")), detail=str(entry.get("detail", "")))
        for name, entry in index.items()
    }
    for path in sorted(directory.glob("*.txt")):
        entry = index.get(path.stem, {})
        data, detail = read_bounded(path), str(entry.get("detail", ""))
        if len(data) > MAX_PROBE_BYTES:
            data, detail = data[:MAX_PROBE_BYTES], f"{detail} (only the first {MAX_PROBE_BYTES} bytes read)".strip()
        results[path.stem] = ProbeResult(path.stem, str(entry.get("status", "ok")), decode(data), detail)
    return results


def read_bounded(path: Path, limit: int = MAX_PROBE_BYTES) -> bytes:
    """The first ``limit`` bytes of a file, plus one more byte when there are more."""
    with path.open("rb") as handle:
        return handle.read(limit + 1)


def decode(data: bytes) -> str:
    """Bytes of a tool output -> text, whatever encoding Windows or a terminal saved it in."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        text = data.decode("utf-16", errors="replace")
    elif len(data) > 1 and data[1:2] == b"\x00" and data[0:1] != b"\x00":
        text = data.decode("utf-16-le", errors="replace")  # UTF-16 without a BOM
    else:
        text = data.decode("utf-8-sig", errors="replace")
    return text.replace("\r\n", "\n").replace("\r", "\n")
