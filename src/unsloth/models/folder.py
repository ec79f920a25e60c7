"""A local model folder checked before anything loads it: config.json, a model_type transformers
knows, and weights that are all there. Training and export both ask, each wording the fix its way.

Pure reads of small files (config.json, index files, safetensors headers); no weights are loaded.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

# transformers' own names for a checkpoint's weights, whole or sharded (with an index).
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


def model_folder_problem(folder: Path, trust_remote_code: bool = False) -> str | None:
    """What is wrong with a model folder, in one phrase naming the file; None when it looks loadable."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        return f"{folder} has no config.json, so it is not a model folder (it holds: {_listing(folder)})"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"{config_path} is not readable JSON ({exc})"
    if not isinstance(config, dict):
        return f"{config_path} is not a JSON object"
    model_type = config.get("model_type")
    if not model_type:
        return f"{config_path} has no model_type, so transformers cannot tell which architecture it is"
    if not _known_model_type(model_type) and not (trust_remote_code and config.get("auto_map")):
        return (f"{config_path}: model_type {model_type!r} is not an architecture this transformers knows "
                "(a newer model, or a typo)")
    return weights_problem(folder)


def weights_problem(folder: Path, names: tuple[str, ...] = WEIGHT_FILES, indexes: tuple[str, ...] = INDEX_FILES) -> str | None:
    """None when the folder's weights are present and whole (as far as headers tell)."""
    for index in indexes:
        index_path = folder / index
        if index_path.is_file():
            try:
                shards = sorted(set(json.loads(index_path.read_text(encoding="utf-8"))["weight_map"].values()))
            except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
                return f"{index_path} is not a readable weight index ({type(exc).__name__})"
            missing = [shard for shard in shards if not (folder / shard).is_file()]
            if missing:
                return f"{folder} is missing weight files its index lists: {', '.join(missing[:3])}"
            return next(filter(None, (safetensors_problem(folder / s) for s in shards if s.endswith(".safetensors"))),
                        None)
    found = [folder / name for name in names if (folder / name).is_file()]
    if not found:
        return f"{folder} has no weights ({' or '.join(names)}; it holds: {_listing(folder)})"
    return next(filter(None, (safetensors_problem(p) for p in found if p.suffix == ".safetensors")), None)


def safetensors_problem(path: Path) -> str | None:
    """A truncated or foreign .safetensors file, from its header alone: 8-byte length, JSON, offsets."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{path} is truncated ({size} bytes: not even a safetensors header)"
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            return f"{path} is truncated or not a safetensors file (its header says {length} bytes, the file has {size})"
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return f"{path} is not a safetensors file (its header is not JSON)"
    if not isinstance(header, dict):
        return f"{path} is not a safetensors file"
    ends = [entry.get("data_offsets", (0, 0))[1] for key, entry in header.items()
            if key != "__metadata__" and isinstance(entry, dict)]
    needed = 8 + length + max(ends, default=0)
    if needed > size:
        return f"{path} is truncated: its tensors need {needed} bytes, the file has {size}"
    return None


def parameter_count(folder: Path) -> int:
    """The number of weights in a folder's .safetensors files, from their headers (nothing loaded);
    .bin files count as 16-bit."""
    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        if safetensors_problem(path):
            continue
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        total += sum(math.prod(entry["shape"]) for key, entry in header.items()
                     if key != "__metadata__" and isinstance(entry, dict) and "shape" in entry)
    total += sum(p.stat().st_size // 2 for p in folder.glob("*.bin"))
    return total


def _known_model_type(model_type: str) -> bool:
    from transformers import CONFIG_MAPPING

    return model_type in CONFIG_MAPPING


def _listing(folder: Path, most: int = 5) -> str:
    try:
        names = sorted(p.name for p in folder.iterdir())
    except OSError:
        return "nothing readable"
    if not names:
        return "nothing"
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")
