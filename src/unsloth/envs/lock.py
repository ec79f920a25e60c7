"""One change to the environments at a time: an OS file lock, released by the OS if the holder dies.

install.sh and install.ps1 take the same lock (flock(2) on POSIX, a byte-range lock on Windows)
before they touch the bootstrap environment, and hold it until they end. The `unsloth install`
they start would wait for its own parent forever, so they name themselves in UNSLOTH_LOCK_OWNER:
a lock held by that process, when it is one of our ancestors, counts as ours.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Callable

import psutil

OWNER_ENV = "UNSLOTH_LOCK_OWNER"


class InstallLock:
    """Exclusive lock on ``path``. ``on_wait`` is told who holds it before we block."""

    def __init__(self, path: Path, on_wait: Callable[[str], None] | None = None):
        self.path = path
        self.on_wait = on_wait
        self._fd: int | None = None
        self._inherited = False

    def __enter__(self) -> "InstallLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        if not _try_lock(fd) and _held_for_us():
            self._fd, self._inherited = fd, True
            return self
        if not _try_lock(fd):
            if self.on_wait:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() if hasattr(os, "pread") else "?"
                self.on_wait(holder or "?")
            while not _try_lock(fd):
                time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            if not self._inherited:  # an inherited lock stays with the installer that holds it
                _unlock(self._fd)
            os.close(self._fd)
            self._fd = None


def _held_for_us() -> bool:
    """The lock is held by the installer script that started us (UNSLOTH_LOCK_OWNER, an ancestor)."""
    owner = os.environ.get(OWNER_ENV, "")
    if not owner.isdigit():
        return False
    try:
        return int(owner) in {parent.pid for parent in psutil.Process().parents()}
    except psutil.Error:
        return False


if sys.platform == "win32":
    import msvcrt

    def _try_lock(fd: int) -> bool:
        try:
            os.lseek(fd, 0, os.SEEK_SET)
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
            return True
        except OSError:
            return False

    def _unlock(fd: int) -> None:
        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)

else:
    import fcntl

    def _try_lock(fd: int) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def _unlock(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)
