"""Host-time measurements shared by the benchmarks: the time to issue a step, and cProfile over a few calls."""

from __future__ import annotations

import collections
import contextlib
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch

CATEGORIES = (  # first match wins; what is left is Triton (ours, or Liger's / Unsloth's)
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("matmul", ("gemm", "gemv", "cutlass", "sm90", "nvjet", "matmul")),
    ("nf4 dequant", ("dequant", "4bit")),
    ("copy/memset", ("memcpy", "memset")),
    ("optimizer", ("adam",)),
    ("elementwise (torch)", ("at::native", "elementwise", "reduce_kernel")),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "triton"


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


PROFILE = os.environ.get("BENCH_PROFILE", "0")  # "1": kernels (torch.profiler); "python": the host's Python
# (cProfile); "memory": what is allocated at the step's peak, by where


def gpu_time(prof):
    """A torch.profiler run's kernels as (name, GPU us, calls) rows, and their GPU us summed by category."""
    rows = [(e.key, e.device_time_total, e.count) for e in prof.key_averages()
            if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    by_cat = collections.Counter()
    for key, t, _ in rows:
        by_cat[category(key)] += t
    return rows, by_cat


@contextlib.contextmanager
def kernel_profile(label: str, enabled: bool = True, top: int = 15):
    """With BENCH_PROFILE=1, profile what runs inside (one training step) and print one JSON line:
    the wall time, the GPU kernels' summed time by category and the top kernels. Kernels summing far
    below the wall time mean a host-paced step; otherwise the categories say where the GPU goes.
    The profiled step is one of the benches' timed ones and runs slower: take step times from a
    run without BENCH_PROFILE."""
    if PROFILE == "python" and enabled:
        with python_profile(label):
            yield
        return
    if PROFILE == "memory" and enabled and torch.cuda.is_available():
        with memory_at_peak(label, top):
            yield
        return
    if not (PROFILE == "1" and enabled and torch.cuda.is_available()):
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        yield
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    rows, by_cat = gpu_time(prof)
    host = sorted((e for e in prof.key_averages() if e.device_type.name == "CPU"), key=lambda e: -e.self_cpu_time_total)
    print(json.dumps({
        "profile": label, "wall_ms_profiled": round(wall * 1e3, 1), "gpu_ms": round(sum(by_cat.values()) / 1e3, 1),
        "kernels": sum(n for _, _, n in rows), "by_category_ms": {k: round(v / 1e3, 1) for k, v in by_cat.most_common()},
        "top": [[round(t / 1e3, 2), n, key[:90]] for key, t, n in sorted(rows, key=lambda r: -r[1])[:top]],
        # where the host's time goes (self time of each op), for steps whose kernels sum below their wall time
        "host_top": [[round(e.self_cpu_time_total / 1e3, 1), e.count, e.key[:60]] for e in host[:top]],
    }), flush=True)


@contextlib.contextmanager
def memory_at_peak(label: str, top: int = 15):
    """BENCH_PROFILE=memory: what is allocated when the step inside reaches its peak, by where it was
    allocated (the innermost frames of ours, transformers' or the bench's code), in one JSON line.
    What was allocated before the step (weights, optimizer states, gradients kept) is one sum."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        yield
        torch.cuda.synchronize()
        events = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    live, total, peak, at_peak = {}, 0, 0, {}
    for event in events:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
        # allocated bytes (max_memory_allocated's count) drop when a free is asked for; the block may
        # wait for other streams' work before it can be reused
        elif event["action"] == "free_requested" and live.pop(event["addr"], None) is not None:
            total -= event["size"]
        if total > peak:
            peak, at_peak = total, dict(live)
    by_site = collections.Counter()
    for event in at_peak.values():
        by_site[_site(event.get("frames", []))] += event["size"]
    print(json.dumps({
        "memory": label, "before_gib": round(before / 2**30, 3), "peak_gib": round((before + peak) / 2**30, 3),
        "step_peak_gib": round(peak / 2**30, 3), "alive_at_peak": len(at_peak),
        "by_site_mib": [[round(n / 2**20, 1), site] for site, n in by_site.most_common(top)],
    }), flush=True)


def _site(frames) -> str:
    """The innermost two frames in our code, transformers' or the bench's; else the innermost frame."""
    mine = [f for f in frames if any(k in f.get("filename", "") for k in ("unsloth", "transformers", "bench", "peft"))]
    chosen = (mine or frames)[:2]
    return " < ".join(f"{f['filename'].rsplit('/', 2)[-1]}:{f['line']}:{f['name']}" for f in chosen) or "(no Python frame)"


@contextlib.contextmanager
def python_profile(label: str, lines: int = 45):
    """cProfile over what runs inside (BENCH_PROFILE=python): the host's Python by function, for
    host-paced steps. The report goes to $OUT/<label>.cprofile.txt (else stderr), a JSON line says so."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    try:
        yield
        sync()
    finally:
        profiler.disable()
    wall = time.perf_counter() - t0
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    for order in ("tottime", "cumulative"):
        stats.sort_stats(order).print_stats(lines)
    out = os.environ.get("OUT")
    path = os.path.join(out, label.replace(" ", "_") + ".cprofile.txt") if out else None
    if path:
        with open(path, "w") as f:
            f.write(text.getvalue())
    else:
        print(text.getvalue(), file=sys.stderr)
    print(json.dumps({"python_profile": label, "wall_ms_profiled": round(wall * 1e3, 1), "report": path}), flush=True)


def profile_step_callback(at_step: int, label: str):
    """A Trainer callback running optimizer step `at_step` under kernel_profile (BENCH_PROFILE=1)."""
    from transformers import TrainerCallback

    class ProfileStep(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == at_step and not hasattr(self, "ctx"):  # once, if called per micro-step
                self.ctx = kernel_profile(label)
                self.ctx.__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == at_step + 1 and getattr(self, "ctx", None) is not None:
                self.ctx.__exit__(None, None, None)
                self.ctx = None

    return ProfileStep()
