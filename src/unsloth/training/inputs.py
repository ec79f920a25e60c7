"""What a config points at, checked before any work: local dataset files and the model folder.

`datasets` would otherwise answer an empty file with StopIteration, a broken line with a
DatasetGenerationError without its line number, and a folder of other files with "no task.toml";
transformers a config.json without model_type with a traceback. Each check raises a ConfigError
that names the file (and line) and the fix.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from unsloth.models.folder import model_folder_problem
from unsloth.training.config import ConfigError, ModelConfig

# Suffixes `datasets` reads from a folder (its packaged builders).
DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".tsv", ".txt", ".arrow")
KEPT = "nothing was trained or written"
SHAPES_FIX = ("one JSON object per line, e.g. {\"messages\": [{\"role\": \"user\", \"content\": \"...\"}, "
              "{\"role\": \"assistant\", \"content\": \"...\"}]} (or prompt + completion, or text)")


def check_data_file(path: Path) -> None:
    """A local .jsonl / .json / .csv / .parquet file has rows, and every JSON line parses (else: its number)."""
    where = f"dataset.name: {path}"
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise ConfigError(f"{where}: cannot be read ({exc.strerror})", "check the path and its permissions",
                          kept=KEPT) from exc
    if size == 0:
        raise ConfigError(f"{where} is empty", f"add training examples, {SHAPES_FIX}", kept=KEPT)
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        with open(path, "rb") as f:
            head = f.read(4)
            f.seek(max(size - 4, 0))
            tail = f.read(4)
        if head != b"PAR1" or tail != b"PAR1":
            raise ConfigError(f"{where} is not a Parquet file (or it is truncated)",
                              "write it again with pandas/pyarrow `to_parquet`, or use .jsonl", kept=KEPT)
        return
    text = _text(path, where)
    if suffix == ".csv":
        rows = list(csv.reader(text.splitlines()))
        if len([row for row in rows if any(cell.strip() for cell in row)]) < 2:
            raise ConfigError(f"{where} has no rows under its header line", "add rows, one example per line",
                              kept=KEPT)
        return
    if suffix == ".json" and text.lstrip().startswith("["):  # one JSON array of rows
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: not valid JSON at line {exc.lineno}, column {exc.colno} ({exc.msg})",
                              f"correct line {exc.lineno}", kept=KEPT) from None
        if not rows or not all(isinstance(row, dict) for row in rows):
            raise ConfigError(f"{where}: the array holds no rows (JSON objects)", f"give {SHAPES_FIX}", kept=KEPT)
        return
    rows = 0
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: line {number} is not valid JSON ({exc.msg}, column {exc.colno})",
                              f"correct or delete line {number} (each line is one JSON object)", kept=KEPT) from None
        if not isinstance(row, dict):
            raise ConfigError(f"{where}: line {number} is {type(row).__name__} JSON, not an object",
                              f"make each line {SHAPES_FIX}", kept=KEPT)
        rows += 1
    if rows == 0:
        raise ConfigError(f"{where} holds only blank lines", f"add training examples, {SHAPES_FIX}", kept=KEPT)


def check_data_folder(path: Path) -> None:
    """A dataset folder holds data files `datasets` can read, not only other files."""
    try:
        found = [p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in DATA_SUFFIXES]
        others = sorted(p.name for p in path.iterdir())
    except OSError as exc:
        raise ConfigError(f"dataset.name: {path}: cannot be read ({exc.strerror})",
                          "check the folder and its permissions", kept=KEPT) from exc
    if not found:
        holds = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "") or "nothing"
        raise ConfigError(f"dataset.name: the folder {path} holds no data files ({', '.join(DATA_SUFFIXES)}); "
                          f"it holds: {holds}", "point dataset.name at a .jsonl file (or a folder of them)",
                          kept=KEPT)
    for data_file in found:
        if data_file.suffix.lower() in (".jsonl", ".json", ".csv", ".parquet"):
            check_data_file(data_file)


def check_model(model: ModelConfig) -> None:
    """A local model folder (model.name is a path that exists) is checked; a hub name is left to the loader."""
    folder = Path(model.name).expanduser()
    if not folder.is_dir():
        return
    problem = model_folder_problem(folder, trust_remote_code=model.trust_remote_code)
    if problem:
        raise ConfigError(f"model.name: {problem}",
                          "point model.name at a folder written by save_pretrained (config.json with model_type, "
                          "and its weights), or a Hugging Face model name", kept=KEPT)


def _text(path: Path, where: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[: exc.start].count(b"\n") + 1
        raise ConfigError(f"{where}: line {line} is not UTF-8 text (a binary file?)",
                          "save the file as UTF-8 text", kept=KEPT) from None
