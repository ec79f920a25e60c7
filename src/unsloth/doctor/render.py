"""Showing a Platform and doctor's findings: rich tables and lines for people, JSON for programs."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from unsloth.doctor.findings import Finding
from unsloth.platform.facts import Gpu, Platform

ICONS = {"ok": ("✓", "green"), "warning": ("!", "yellow"), "error": ("✗", "red"), "skipped": ("-", "dim")}
GIB = 2**30


def console() -> Console:
    # Data goes to stdout; highlight=False keeps rich from colouring numbers inside messages.
    return Console(highlight=False, soft_wrap=True)


def _yes_no(value: bool | None) -> str:
    return {True: "yes", False: "no", None: "unknown"}[value]


def _gib(n: int | None) -> str:
    return f"{n / GIB:.1f} GiB" if n else "unknown"


def _fact_table(title: str, columns: tuple[str, ...]) -> Table:
    table = Table(title=title, title_justify="left", title_style="bold")
    for column in columns:
        table.add_column(column, style="dim" if column == "from" else None, overflow="fold")
    return table


def machine_table(platform: Platform) -> Table:
    """The machine's facts, each with the probe that said it."""
    table = _fact_table("Machine", ("fact", "value", "from"))
    override = platform.hsa_override
    if override and platform.hsa_override_spoofs:
        override += " (changes the GPU the runtime reports)"
    elif override is None and platform.probes.get("env") == "ok":
        override = "not set"  # the environment was read and holds none; "unknown" is for dumps without it
    rows = [
        ("OS", "os", platform.os),
        ("WSL", "wsl", _yes_no(platform.wsl) + (f" (WSL {platform.wsl_version})" if platform.wsl_version else "")),
        ("Machine", "machine", platform.machine),
        ("Kernel", "kernel", platform.kernel),
        ("Distribution", "distro", platform.distro),
        ("CPU", "cpu", platform.cpu),
        ("RAM", "ram_bytes", _gib(platform.ram_bytes)),
        ("NVIDIA driver", "nvidia_driver", platform.nvidia_driver),
        ("CUDA (driver)", "cuda_driver", platform.cuda_driver),
        ("ROCm", "rocm_version", platform.rocm_version),
        ("/dev/kfd", "dev_kfd", _yes_no(platform.dev_kfd)),
        ("/dev/dxg", "dev_dxg", _yes_no(platform.dev_dxg)),
        ("HSA override", "hsa_override", override),
    ]
    for label, key, value in rows:
        table.add_row(label, Text(value or "unknown"), platform.provenance.get(key, ""))  # probe text, not markup
    return table


def gpu_table(n: int, gpu: Gpu) -> Table:
    """One GPU as a column of facts: readable in any terminal width, however many GPUs there are."""
    table = _fact_table(f"GPU {n}: {escape(gpu.name or 'unknown name')}", ("fact", "value"))
    arch = gpu.arch or "unknown"
    if gpu.reported_arch and gpu.reported_arch != gpu.arch:
        arch += f" (the runtime reports {gpu.reported_arch})"
    for label, value in [
        ("vendor", gpu.vendor),
        ("arch", arch),
        ("family", gpu.family),
        ("VRAM", _gib(gpu.vram_bytes)),
        ("integrated", _yes_no(gpu.integrated)),
        ("PCI id", gpu.pci_id),
        ("compute capability", gpu.compute_capability if gpu.vendor == "nvidia" else None),
        ("seen by", ", ".join(gpu.sources)),
    ]:
        if label != "compute capability" or value:
            table.add_row(label, Text(value or "unknown"))
    return table


def print_platform(platform: Platform, out: Console | None = None) -> None:
    out = out or console()
    out.print(machine_table(platform))
    for n, gpu in enumerate(platform.gpus):
        out.print(gpu_table(n, gpu))
    if not platform.gpus:
        out.print(Text("No GPU found: training would run on the CPU (slow).", style="yellow"))
    for note in platform.notes:
        out.print(Text(f"note: {note}", style="yellow"))
    if platform.probes:
        probes = ", ".join(f"{name} {status}" for name, status in sorted(platform.probes.items()))
        out.print(Text(f"probes: {probes}", style="dim"))


def _grouped(findings: list[Finding]) -> list[tuple[str, str, Finding]]:
    """(title, message, finding) per line: a run of findings skipped for one reason is one line."""
    runs: list[list[Finding]] = []
    for finding in findings:
        last = runs[-1][-1] if runs else None
        if last is not None and finding.status == last.status == "skipped" and finding.message == last.message:
            runs[-1].append(finding)
        else:
            runs.append([finding])
    lines = []
    for run in runs:
        if len(run) == 1:
            lines.append((run[0].title, run[0].message, run[0]))
        else:
            lines.append((f"{len(run)} checks", f"{run[0].message}: {', '.join(f.title for f in run)}", run[0]))
    return lines


def print_findings(findings: list[Finding], summary: dict[str, Any], *, verbose: bool = False,
                   out: Console | None = None) -> None:
    """One line per finding (icon, title, message), its fix under it; with verbose, its evidence too."""
    out = out or console()
    lines = [(f.title, f.message, f) for f in findings] if verbose else _grouped(findings)
    width = max((len(title) for title, _, _ in lines), default=0)
    indent = " " * (width + 5)
    for title, message, finding in lines:
        icon, colour = ICONS[finding.status]
        skipped = finding.status == "skipped"
        out.print(Text.assemble((f" {icon} ", colour), (title.ljust(width), "dim" if skipped else "bold"), "  ",
                                (message, "dim" if skipped else "")))
        if finding.fix and finding.status in ("warning", "error"):
            out.print(Text.assemble(indent, ("fix: ", colour), finding.fix))
        if verbose and finding.detail:
            for detail_line in finding.detail.splitlines():
                out.print(Text(indent + detail_line, style="dim"))
    out.print(summary_line(summary))


def _count(n: int, status: str) -> str:
    noun = {"warning": "warning", "error": "error"}.get(status)
    return f"{n} {noun}{'s' if n != 1 else ''}" if noun else f"{n} {status}"


def summary_line(summary: dict[str, Any]) -> Text:
    counts = ", ".join(_count(summary[s], s) for s in ("ok", "warning", "error", "skipped") if summary[s])
    if summary["failed_required"]:
        return Text(f"Not ready: {', '.join(summary['failed_required'])} failed ({counts})", style="bold red")
    if summary["warning"] or summary["error"]:
        return Text(f"Ready, with warnings ({counts})", style="bold yellow")
    return Text(f"Ready ({counts})", style="bold green")
