"""Facts only the live machine can give doctor: device access, groups, free disk, shell rc lines.

Gathering is the only side effect here; the checks that judge these facts are pure
(unsloth.doctor.checks), so they are tested on constructed HostFacts. A dump from another
machine has no HostFacts, and the checks that need them say "skipped".
"""

from __future__ import annotations

import getpass
import glob
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

# Where users put `export HSA_OVERRIDE_GFX_VERSION=...` (that a forum told them to) and forget it.
SHELL_RC_FILES = (".bashrc", ".bash_profile", ".profile", ".zshrc", ".zprofile")
_OVERRIDE_LINE = re.compile(r"^\s*(export\s+)?HSA_OVERRIDE_GFX_VERSION\w*=")


@dataclass
class DeviceNode:
    path: str
    accessible: bool  # this process may read and write it
    group: str | None = None  # the group that owns it ("render", "video")


@dataclass
class RcLine:
    path: str  # "~/.bashrc" as the user would type it
    lineno: int
    text: str


@dataclass
class HostFacts:
    user: str
    groups: list[str] = field(default_factory=list)  # this process's groups, now
    member_of: list[str] = field(default_factory=list)  # /etc/group's list: differs until re-login
    kfd: DeviceNode | None = None  # None: /dev/kfd does not exist
    render_nodes: list[DeviceNode] = field(default_factory=list)  # /dev/dri/renderD*
    wsl_lib_dir: bool = False  # /usr/lib/wsl/lib: where Windows injects libcuda and libdxcore
    data_dir: str = ""  # where managed environments live
    disk_free_bytes: int | None = None  # free space on data_dir's file system
    rc_overrides: list[RcLine] = field(default_factory=list)
    gpu_topology: str | None = None  # `nvidia-smi topo -m` / `rocm-smi --showtopo` output, with 2+ GPUs


def _gpu_topology() -> str | None:
    """The GPU link matrix's text from whichever tool is installed (parsed by platform.parsers.gpu_topology)."""
    import subprocess

    for command in (["nvidia-smi", "topo", "-m"], ["rocm-smi", "--showtopo"]):
        if shutil.which(command[0]) is None:
            continue
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0 and "GPU1" in done.stdout:
            return done.stdout
    return None


def _group_name(gid: int) -> str:
    import grp

    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _device(path: str) -> DeviceNode | None:
    if not os.path.exists(path):
        return None
    group = _group_name(os.stat(path).st_gid) if sys.platform != "win32" else None
    return DeviceNode(path, os.access(path, os.R_OK | os.W_OK), group)


def _groups(user: str) -> tuple[list[str], list[str]]:
    if sys.platform == "win32":
        return [], []
    import grp

    # getgroups() lists the supplementary groups only; the primary one counts for access too.
    now = sorted({_group_name(gid) for gid in (os.getegid(), *os.getgroups())})
    listed = sorted(g.gr_name for g in grp.getgrall() if user in g.gr_mem)
    return now, listed


def _existing_parent(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _rc_overrides(home: Path) -> list[RcLine]:
    found = []
    for name in SHELL_RC_FILES:
        try:
            lines = (home / name).read_text(errors="replace").splitlines()
        except OSError:
            continue
        found += [RcLine(f"~/{name}", n, line.strip()) for n, line in enumerate(lines, 1) if _OVERRIDE_LINE.match(line)]
    return found


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # a container's uid with no passwd entry and no $USER
        return str(os.getuid()) if hasattr(os, "getuid") else "?"


def gather_host_facts(data_dir: Path) -> HostFacts:
    user = _user()
    groups, member_of = _groups(user)
    return HostFacts(
        user=user,
        groups=groups,
        member_of=member_of,
        kfd=_device("/dev/kfd"),
        render_nodes=[node for p in sorted(glob.glob("/dev/dri/renderD*")) if (node := _device(p))],
        wsl_lib_dir=os.path.isdir("/usr/lib/wsl/lib"),
        data_dir=str(data_dir),
        disk_free_bytes=shutil.disk_usage(_existing_parent(data_dir)).free,
        rc_overrides=_rc_overrides(Path.home()),
        gpu_topology=_gpu_topology(),
    )
