"""Host-time measurements shared by the benchmarks: the time to issue a step, and cProfile over a few calls."""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import time

import torch


def host_us(step, n=20, batches=7):
    """Median over batches of the host time to issue one step. Leases' hosts are shared and noisy,
    and the first steps after a warm-up still pay for lazy set-up: one long batch would average
    both in."""
    for _ in range(20):
        step()
    per_step = []
    for _ in range(batches):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        per_step.append((time.perf_counter() - t0) / n * 1e6)
    torch.cuda.synchronize()
    return round(statistics.median(per_step), 1)


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


def step_timer(times: list[float], warmup: int):
    """A Trainer callback appending each optimizer step's wall time to `times` (the GPU synchronized
    at both ends); the peak-memory counter restarts when the timed steps (after `warmup`) begin."""
    from transformers import TrainerCallback

    cuda = torch.cuda.is_available()

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
                if state.global_step == warmup:
                    torch.cuda.reset_peak_memory_stats()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.start)

    return StepTimer()
