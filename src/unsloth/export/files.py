"""Writing outputs safely: a final name appears only when its file is complete; space is checked first."""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from unsloth.export.errors import ExportError

GIB = 1024**3


@contextmanager
def atomic_output(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; move it into place only if the block succeeds.

    The temporary file lives in the same directory so the final ``os.replace`` is atomic. On any
    failure (an exception, Ctrl-C, a full disk) it is removed and ``path`` is left untouched.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        yield partial
        os.replace(partial, path)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise ExportError(
                f"the disk filled up while writing {path.name}; the partial file was removed "
                "and nothing under that name was written",
                fix=f"free space on the disk holding {path.parent} or choose another --out directory",
            ) from exc
        raise
    finally:
        partial.unlink(missing_ok=True)


def ensure_free_space(directory: Path, needed: int) -> None:
    """Refuse early, before hours of work, when the outputs cannot fit."""
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    margin = max(needed // 20, 64 * 1024**2)  # metadata, filesystem slack
    if free < needed + margin:
        raise ExportError(
            f"the export needs about {(needed + margin) / GIB:.2f} GiB in {directory}, "
            f"but only {free / GIB:.2f} GiB is free",
            fix="free some space there or pass another output directory (--out DIR)",
        )
