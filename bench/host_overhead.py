"""Host time to issue one forward + backward of the small kernels (ours and Liger's), and where it goes.

On ops this fast the host, not the GPU, sets the time the anchors measure. Per op: do_bench ms
(as the anchors time it), GPU ms (CUDA graph replay), host µs per step (issue rate with the GPU
queue not yet full), then cProfile's top entries for our implementation.

    python bench/host_overhead.py [--only rmsnorm,add_rmsnorm,layernorm,rope]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

import unsloth_kernels as uk

from bench_kernels import graph_ms, liger_ops, rope_inputs
from profiling import cprofile_report, host_us

DEV, DT = "cuda", torch.bfloat16
T, H = 16384, 4096


def report(op, impl, step, profile_it):
    row = {"op": op, "impl": impl,
           "ms": round(triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median"), 4),
           "graph_ms": graph_ms(step), "host_us": host_us(step)}
    print(json.dumps(row), flush=True)
    if profile_it:
        print(cprofile_report(step, 50, orders=("tottime", "cumulative"), lines=25))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--only", default="rmsnorm,add_rmsnorm,layernorm,rope")
    only = p.parse_args().only.split(",")
    liger = liger_ops()
    if "rmsnorm" in only:
        x = torch.randn(T, H, device=DEV, dtype=DT, requires_grad=True)
        w = torch.ones(H, device=DEV, dtype=DT, requires_grad=True)
        dy = torch.randn(T, H, device=DEV, dtype=DT)
        for impl, f in (("ours", lambda x, w: uk.rms_norm(x, w, 1e-5)), ("liger", liger and liger["rmsnorm"])):
            if f is None:
                continue

            def step(f=f):
                x.grad = w.grad = None
                f(x, w).backward(dy)
            report("rmsnorm", impl, step, impl == "ours")
    if "add_rmsnorm" in only:
        x, r = (torch.randn(T, H, device=DEV, dtype=DT, requires_grad=True) for _ in range(2))
        w = torch.ones(H, device=DEV, dtype=DT, requires_grad=True)
        dy, ds = torch.randn(T, H, device=DEV, dtype=DT), torch.randn(T, H, device=DEV, dtype=DT)
        for impl, f in (("ours", lambda x, r, w: uk.rms_norm(x, w, 1e-5, residual=r)),
                        ("liger", liger and liger["add_rmsnorm"])):
            if f is None:
                continue

            def step(f=f):  # as bench_kernels.py times it
                torch.autograd.grad(f(x, r, w), (x, r, w), (dy, ds))
            report("add_rmsnorm", impl, step, impl == "ours")
    if "layernorm" in only:
        x = torch.randn(T, H, device=DEV, dtype=DT, requires_grad=True)
        w = torch.ones(H, device=DEV, dtype=DT, requires_grad=True)
        b = torch.zeros(H, device=DEV, dtype=DT, requires_grad=True)
        dy = torch.randn(T, H, device=DEV, dtype=DT)
        for impl, f in (("ours", uk.layer_norm), ("liger", liger and liger["layernorm"]),
                        ("eager", lambda x, w, b: torch.nn.functional.layer_norm(x, (H,), w, b, 1e-5))):
            if f is None:
                continue

            def step(f=f):
                x.grad = w.grad = b.grad = None
                f(x, w, b).backward(dy)
            report("layernorm", impl, step, impl == "ours")
    if "rope" in only:
        q, k, cos, sin, dq, dk = rope_inputs()
        for impl, f in (("ours", uk.apply_rope), ("liger", liger and liger["rope"])):
            if f is None:
                continue

            def step(f=f):
                q.grad = k.grad = None
                oq, ok = f(q, k, cos, sin)
                torch.autograd.backward([oq, ok], [dq, dk])
            report("rope", impl, step, impl == "ours")


if __name__ == "__main__":
    main()
