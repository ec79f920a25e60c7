"""Writing outputs safely: a final name appears only when its file is complete; space is checked first."""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from unsloth.export.errors import ExportError

GIB = 1024**3


PARTIAL = ".{name}.partial-{pid}"  # hidden, beside the final name, and owned by one process


def partial_path(path: Path) -> Path:
    return path.with_name(PARTIAL.format(name=path.name, pid=os.getpid()))


def sweep_partials(directory: Path) -> list[Path]:
    """Remove the partial files of exports that were killed (SIGKILL, a power cut): their process is gone."""
    removed = []
    for candidate in directory.glob(".*.partial-*") if directory.is_dir() else ():
        pid = candidate.name.rpartition(".partial-")[2]
        if pid.isdigit() and int(pid) != os.getpid() and not psutil.pid_exists(int(pid)):
            candidate.unlink(missing_ok=True)
            removed.append(candidate)
    return removed


@contextmanager
def atomic_output(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; move it into place only if the block succeeds.

    The temporary file lives in the same directory so the final ``os.replace`` is atomic. On any
    failure (an exception, Ctrl-C, SIGTERM, a full disk) it is removed and ``path`` is left
    untouched; what a SIGKILL leaves is a hidden partial file, which the next export there removes.
    """
    with scratch_file(path) as partial:
        yield partial
        os.replace(partial, path)


@contextmanager
def scratch_file(path: Path) -> Iterator[Path]:
    """A hidden file beside ``path`` that never gets a final name (an intermediate, like the f16 a
    quantization reads); removed when the block ends, however it ends."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_partials(path.parent)
    partial = partial_path(path)
    try:
        yield partial
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EFBIG):
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
