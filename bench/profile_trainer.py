"""Where one training step's GPU time and peak memory go, for any implementation the anchor harness
loads (ours answers `import unsloth` when our source is first on PYTHONPATH).

    python bench/profile_trainer.py --harness .anchors/anchor_lora.py --impl unsloth [--four-bit --batch 2] [--host]

With --host it shows instead where the host's time goes (for a step the host, not the GPU, paces):
the step's wall time, the time to issue it, the operations that made the host wait for the GPU,
and cProfile's top functions. Otherwise it prints JSON lines: GPU time per kernel category
(torch.profiler, one step after warm-up), the top kernels, matmul time and TFLOP/s by input shape,
and what is alive at the step's memory peak,
grouped by the source line that allocated it (torch.cuda.memory history). That last list is an
upper bound: a block freed through `record_stream` (the offloaded layer inputs) can lack its
"free_completed" event and show as alive; compare its total with max_memory_allocated.
"""

from __future__ import annotations

import collections
import json
import os
import sys

harness = sys.argv[sys.argv.index("--harness") + 1]
del sys.argv[sys.argv.index("--harness"): sys.argv.index("--harness") + 2]
HOST = "--host" in sys.argv
if HOST:
    sys.argv.remove("--host")
source = open(harness).read().replace('if __name__ == "__main__":\n    main()', "")
exec(compile(source, harness, "exec"))  # defines args, load()

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from profiling import gpu_time  # noqa: E402

model = load(args.impl)  # noqa: F821 - from the harness
base = model.get_base_model() if hasattr(model, "get_base_model") else model
report = getattr(base, "_unsloth_patches", None)  # ours: what was patched
print(json.dumps({"patches": report.summary() if report is not None else None,
                  "input_embedding": type(model.get_input_embeddings()).__name__,
                  "embedding_device": str(model.get_input_embeddings().weight.device)}))
params = [q for q in model.parameters() if q.requires_grad]
opt = torch.optim.AdamW(params, lr=2e-4, fused=True)


def step():
    ids = torch.randint(0, 128000, (args.batch, args.seq), device="cuda")  # noqa: F821
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


for _ in range(2):
    step()
torch.cuda.synchronize()


def host_profile():
    import time
    import warnings

    from profiling import cprofile_report

    walls = []
    for _ in range(4):
        t0 = time.perf_counter()
        step()
        issued = time.perf_counter() - t0
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0, issued))
    print(json.dumps({"step_wall_s": [round(w, 4) for w, _ in walls], "issued_s": [round(i, 4) for _, i in walls]}))
    torch.cuda.set_sync_debug_mode("warn")  # every op that waits for the GPU warns: count them by caller
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step()
    torch.cuda.set_sync_debug_mode(0)
    syncs = collections.Counter()
    for w in caught:
        syncs[f"{os.path.basename(w.filename)}:{w.lineno} {str(w.message)[:60]}"] += 1
    print("  host waits for the GPU (sync debug warnings):", json.dumps(syncs.most_common(15)))
    print(cprofile_report(step, 2, orders=("tottime", "cumulative"), lines=45))


if HOST:
    host_profile()
    sys.exit(0)

with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
    step()
    torch.cuda.synchronize()
rows, by_cat = gpu_time(prof)
print(json.dumps({"impl": args.impl, "four_bit": args.four_bit, "gpu_ms": round(sum(by_cat.values()) / 1e3, 1),
                  "by_category_ms": {k: round(v / 1e3, 1) for k, v in by_cat.most_common()}}))
for key, t, _ in sorted(rows, key=lambda r: -r[1])[:25]:
    print(f"  {t / 1e3:8.1f} ms  {key[:120]}")



def matmul_flops(key, shapes):
    """2 M N K from the recorded input shapes of aten::mm / addmm / addmm_ (None if unreadable)."""
    try:
        a, b = (shapes[0], shapes[1]) if key == "aten::mm" else (shapes[1], shapes[2])
        return 2 * a[0] * a[1] * b[1]
    except (IndexError, TypeError):
        return None


print("  matmuls by shape: GPU ms, calls, TFLOP/s, shapes")
mms = [e for e in prof.key_averages(group_by_input_shape=True) if e.key in ("aten::mm", "aten::addmm", "aten::addmm_")]
for e in sorted(mms, key=lambda e: -e.device_time_total)[:30]:
    flops = matmul_flops(e.key, e.input_shapes)
    tflops = flops * e.count / (e.device_time_total * 1e-6) / 1e12 if flops and e.device_time_total else 0
    print(f"  {e.device_time_total / 1e3:8.1f} ms {e.count:5d} {tflops:6.0f}  {e.key} {e.input_shapes}")

# Memory: replay one step's allocation history and list what is alive at its peak.
torch.cuda.synchronize()
torch.cuda.memory._record_memory_history(max_entries=400000)
step()
torch.cuda.synchronize()
snapshot = torch.cuda.memory._snapshot()
torch.cuda.memory._record_memory_history(enabled=None)

baseline = sum(b["size"] for seg in snapshot["segments"] for b in seg["blocks"] if b["state"] == "active_allocated")
trace = snapshot["device_traces"][0]
# Blocks alive before the trace began are the baseline (weights, optimizer state...): measure relative to it.
live, current, peak, peak_at = {}, 0, 0, -1
for i, ev in enumerate(trace):
    if ev["action"] == "alloc":
        live[ev["addr"]] = ev
        current += ev["size"]
    elif ev["action"] in ("free_completed",):
        if live.pop(ev["addr"], None) is not None:
            current -= ev["size"]
    if current > peak:
        peak, peak_at = current, i
live = {}
for ev in trace[: peak_at + 1]:
    if ev["action"] == "alloc":
        live[ev["addr"]] = ev
    elif ev["action"] == "free_completed":
        live.pop(ev["addr"], None)


def site(ev) -> str:
    frames = ev.get("frames") or []
    for f in frames:
        name = f.get("filename", "")
        ours_or_library = any(s in name for s in ("unsloth", "peft", "transformers", "torch/nn/functional", "anchor"))
        if ours_or_library and "profile_trainer" not in name:
            return f"{os.path.basename(name)}:{f.get('line')} {f.get('name')}"
    return frames[0].get("name", "?") if frames else "?"


groups = collections.Counter()
counts = collections.Counter()
for ev in live.values():
    groups[site(ev)] += ev["size"]
    counts[site(ev)] += 1
print(json.dumps({"impl": args.impl, "four_bit": args.four_bit,
                  "max_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                  "step_peak_above_trace_start_gib": round(peak / 2**30, 2),
                  "allocated_at_trace_end_gib": round(baseline / 2**30, 2)}))
print("  alive at the peak, by allocating line (MiB, blocks):")
for where, size in groups.most_common(30):
    print(f"  {size / 2**20:9.1f} MiB {counts[where]:4d}  {where}")
