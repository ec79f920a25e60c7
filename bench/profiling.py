"""cProfile over a few calls of a step, as text: shared by the host-time benchmarks."""

from __future__ import annotations

import cProfile
import io
import pstats

import torch


def cprofile_report(step, calls: int, orders=("tottime",), lines: int = 18) -> str:
    """cProfile's top `lines` functions over `calls` runs of `step`, once per sort order (the GPU is
    drained before and after, so only this host work is counted)."""
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    reports = []
    for order in orders:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(lines)
        reports.append("Ordered by:" + text.getvalue().split("Ordered by:", 1)[1].rstrip())  # no call-count preamble
    return "\n\n".join(reports)
