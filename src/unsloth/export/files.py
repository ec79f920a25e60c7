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
    partial = partial_path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        sweep_partials(path.parent)
        yield partial
    except OSError as exc:
        raise write_error(path, exc) from exc
    finally:
        partial.unlink(missing_ok=True)


# errno -> what happened, for the faults a user can fix (the disk, a limit, permissions).
_FULL = "the disk filled up"
_WRITE_FAULTS = {
    errno.ENOSPC: (_FULL, ""),
    errno.EDQUOT: (_FULL, " (the disk quota ran out)"),
    errno.EFBIG: (_FULL, " (or rather, the file reached the file-size limit: ulimit -f)"),
    errno.EROFS: ("the file system is read-only", ""),
    errno.EACCES: ("permission was denied", ""),
    errno.EPERM: ("permission was denied", ""),
}


def write_error(path: Path, exc: OSError) -> OSError | ExportError:
    """An OSError while writing ``path`` -> an ExportError saying what happened and that nothing was kept.

    numpy's short writes (a full disk, a file-size limit) carry no errno: "44032 requested and 38976 written".
    """
    what, note = _WRITE_FAULTS.get(exc.errno, (None, ""))
    if what is None and exc.errno is None and "requested and" in str(exc) and "written" in str(exc):
        what, note = _FULL, " (or the file reached a size limit)"
    if what is None:
        return exc  # not a fault of the disk: a bug, shown as such
    fix = (f"free space on the disk holding {path.parent}, or choose another output directory (--out DIR)"
           if what == _FULL else "choose an output directory you can write to (--out DIR)")
    return ExportError(f"{what} while writing {path.name} in {path.parent}{note}", fix,
                       kept=f"the partial file was removed and nothing was written under {path.name}")


def _existing(directory: Path) -> Path:
    """``directory`` or its nearest ancestor that exists (the one a mkdir would write into)."""
    directory = directory.absolute()
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent
    return directory


def check_writable(directory: Path) -> None:
    """Refuse a folder that cannot be written (read-only, not ours, a file in the way) before any work."""
    existing = _existing(Path(directory))
    fix = "choose an output directory you can write to (--out DIR)"
    if not existing.is_dir():
        raise ExportError(f"cannot write into {directory}: {existing} is a file, not a folder", fix,
                          kept="nothing was written")
    if not os.access(existing, os.W_OK | os.X_OK):
        reason = "read-only file system" if _read_only(existing) else "permission denied"
        raise ExportError(f"cannot write into {directory} ({reason} at {existing})", fix, kept="nothing was written")


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (AttributeError, OSError):  # Windows has no statvfs
        return False


def ensure_free_space(directory: Path, needed: int) -> None:
    """Refuse early, before hours of work, when the outputs cannot fit (or the folder cannot be written)."""
    check_writable(directory)
    free = shutil.disk_usage(_existing(Path(directory))).free
    margin = max(needed // 20, 64 * 1024**2)  # metadata, filesystem slack
    if free < needed + margin:
        raise ExportError(
            f"the export needs about {(needed + margin) / GIB:.2f} GiB in {directory}, "
            f"but only {free / GIB:.2f} GiB is free",
            fix="free some space there or pass another output directory (--out DIR)",
            kept="nothing was written",
        )
