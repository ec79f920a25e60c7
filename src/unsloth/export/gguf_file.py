"""A .gguf file checked before llama.cpp or the gguf reader sees it: the header, every length in it,
and every tensor's bytes against the file's size.

A truncated download or a text file named .gguf otherwise ends in "cannot reshape array" from the
gguf reader, or worse inside llama.cpp. This reads the header with bounds on everything (no
allocation larger than the file), keeps the scalar metadata (the context length comes from here)
and raises an ExportError naming the file, what is wrong and the fix.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from unsloth.export.errors import ExportError

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # what llama.cpp reads today (1 is long gone)
DEFAULT_ALIGNMENT = 32
FIX = "export it again (`unsloth export CHECKPOINT --gguf q8_0`), or download it again: the file is damaged"
# GGUFValueType -> struct format of a scalar (8 = string, 9 = array are read by hand).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFHeader:
    version: int
    metadata: dict[str, Any] = field(default_factory=dict)  # scalars and strings; arrays as their length
    tensors: int = 0
    data_bytes: int = 0  # what the tensors need after the header


class _Damaged(Exception):
    pass


class _Reader:
    def __init__(self, f: BinaryIO, size: int):
        self.f, self.size = f, size

    def read(self, n: int) -> bytes:
        if n < 0 or self.f.tell() + n > self.size:
            raise _Damaged(f"it ends early: {n} more bytes needed at byte {self.f.tell()} of {self.size}")
        return self.f.read(n)

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.read(self.unpack("<Q")).decode("utf-8", errors="replace")

    def skip(self, n: int) -> None:
        if n < 0 or self.f.tell() + n > self.size:
            raise _Damaged(f"it ends early: an entry of {n} bytes at byte {self.f.tell()} of {self.size}")
        self.f.seek(n, 1)

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.unpack("<I"), self.unpack("<Q")
            if item in _SCALARS:
                self.skip(count * struct.calcsize(_SCALARS[item]))
            elif item == _STRING:
                if count * 8 > self.size:
                    raise _Damaged(f"an array claims {count} strings, more than the file could hold")
                for _ in range(count):
                    self.skip(self.unpack("<Q"))
            else:
                raise _Damaged(f"an array of unknown type {item}")
            return count
        raise _Damaged(f"a metadata value of unknown type {kind}")


def read_header(path: str | Path) -> GGUFHeader:
    """The checked header of ``path``; ExportError when it is not a whole GGUF file."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
        if magic != MAGIC:
            what = "it is empty" if not magic else f"it starts with {magic!r}, not b'GGUF'"
            raise ExportError(f"{path} is not a GGUF file ({what})",
                              "pass a .gguf written by `unsloth export` or llama.cpp")
        try:
            return _read(_Reader(f, size), size)
        except _Damaged as exc:
            raise ExportError(f"{path} is damaged or truncated ({exc})", FIX) from None


def _read(r: _Reader, size: int) -> GGUFHeader:
    version = r.unpack("<I")
    if version not in VERSIONS:
        raise _Damaged(f"GGUF version {version}; this llama.cpp reads versions {', '.join(map(str, VERSIONS))}")
    n_tensors, n_kv = r.unpack("<Q"), r.unpack("<Q")
    if n_tensors * 24 > size or n_kv * 12 > size:  # the smallest tensor info / key-value entry
        raise _Damaged(f"its header claims {n_tensors} tensors and {n_kv} metadata entries, more than {size} bytes hold")
    header = GGUFHeader(version, tensors=n_tensors)
    for _ in range(n_kv):
        key = r.string()
        header.metadata[key] = r.value(r.unpack("<I"))
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    end = 0
    for _ in range(n_tensors):
        name = r.string()
        n_dims = r.unpack("<I")
        if n_dims > 8:
            raise _Damaged(f"tensor {name!r} claims {n_dims} dimensions")
        dims = [r.unpack("<Q") for _ in range(n_dims)]
        kind, offset = r.unpack("<I"), r.unpack("<Q")
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            raise _Damaged(f"tensor {name!r} has unknown type {kind}") from None
        end = max(end, offset + math.prod(dims) // block * type_size)
    alignment = header.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0:
        raise _Damaged(f"general.alignment is {alignment!r}")
    start = -(-r.f.tell() // alignment) * alignment
    header.data_bytes = end
    if start + end > size:
        raise _Damaged(f"its tensors need {start + end} bytes, the file has {size}")
    return header


def context_length(header: GGUFHeader) -> int | None:
    """The context length the model was trained for, from the header's metadata."""
    arch = header.metadata.get("general.architecture")
    value = header.metadata.get(f"{arch}.context_length")
    return int(value) if isinstance(value, int) else None
