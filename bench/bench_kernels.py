"""Benchmark of every unsloth_kernels kernel, forward + backward, at Llama-3.1-8B shapes (bf16).

Measured the way the project's anchor harness measures PyTorch eager, torch.compile and Liger, in
the same process, so the numbers line up with the published anchors: 16,384 tokens (8 x 2048),
hidden 4096, 32 q / 8 kv heads of 128, MLP 14336, vocab 128256.
- ms: the median of triton.testing.do_bench(warmup=25, rep=100), taken in 5 rounds that alternate
  the implementations of an op; the median round counts.
- graph ms (memory-bound ops): the same step replayed from a CUDA graph, the GPU time alone. When
  ms is well above it the step is host-bound (Python, autograd and kernel launches).
- peak: extra device memory over the inputs (GiB).
- GB/s and the floor: the fewest bytes the op must move, against a device-to-device copy roofline
  measured in this run (2 GiB; the NF4 rows also time a copy of their own size).

    python bench/bench_kernels.py                 # everything
    python bench/bench_kernels.py --only rmsnorm,rope --no-compile

Prints one progress line per row to stderr, then a markdown table and one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys

import torch
import torch.nn.functional as F
import triton

import unsloth_kernels as uk

DEV, DT = "cuda", torch.bfloat16
B, S = 8, 2048
T, H, I, V, NH, NKV, HD = B * S, 4096, 14336, 128256, 32, 8, 128
RANK = 16
ROUNDS = 5
SIZE_COPY = "torch copy, same bytes"
ROWS: list[dict] = []


def graph_ms(fn):
    """Median time of `fn` replayed from a CUDA graph (None if it cannot be captured)."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return round(triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median"), 4)
    except Exception as e:  # noqa: BLE001 - a diagnostic column only
        print(json.dumps({"graph": f"{type(e).__name__}: {e}"[:200]}), file=sys.stderr)
        return None


def peak_gib(step) -> float:
    """Device memory one call of `step` takes beyond what is allocated before it (GiB)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def bench(op, steps: dict, *, bytes_moved=None, flops=None, graph=False):
    """Time each implementation's step of one op (`steps`: impl -> step) and add a row per impl.

    An impl's ms is the median of ROUNDS do_bench medians, the rounds taking the implementations
    in turn. On the small ops the host's time to issue a step is part of what do_bench measures,
    and the leases' hosts are shared and noisy: alternating keeps a burst of that noise from
    landing on one implementation alone.
    """
    peaks = {impl: peak_gib(step) for impl, step in steps.items()}  # also compiles and warms up
    times = {impl: [] for impl in steps}
    for _ in range(ROUNDS):
        for impl, step in steps.items():
            times[impl].append(triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median"))
    for impl, step in steps.items():
        ms = statistics.median(times[impl])
        row = {"op": op, "impl": impl, "ms": round(ms, 4), "rounds": [round(t, 4) for t in times[impl]],
               "peak_gib": round(peaks[impl], 3)}
        if bytes_moved:
            row["bytes"] = bytes_moved
            row["GBps"] = round(bytes_moved / ms / 1e6, 1)
        if flops:
            row["TFLOPs"] = round(flops / ms / 1e9, 1)
        if graph and not impl.startswith("compile"):
            row["graph_ms"] = graph_ms(step)
        ROWS.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)


def implementations(eager, ours, liger=None, compile_=True):
    impls = [("eager", eager)]
    if compile_:
        impls.append(("compile", torch.compile(eager)))
    if liger is not None:
        impls.append(("liger", liger))
    impls.append(("unsloth_kernels", ours))
    return impls


def liger_ops():
    try:
        from liger_kernel.ops import (fused_add_rms_norm, fused_linear_cross_entropy, geglu, layer_norm, rms_norm,
                                      rope, swiglu)
    except Exception as e:  # noqa: BLE001 - optional comparison
        print(json.dumps({"liger": f"unavailable: {e}"}), file=sys.stderr)
        return None
    return {
        "rmsnorm": lambda x, w: rms_norm.LigerRMSNormFunction.apply(x, w, 1e-5, 0.0, "llama", False),
        "add_rmsnorm": lambda x, r, w: fused_add_rms_norm.LigerFusedAddRMSNormFunction.apply(x, r, w, 1e-5),
        "layernorm": lambda x, w, b: layer_norm.LigerLayerNormFunction.apply(x, w, b, 1e-5),
        "geglu": lambda a, b: geglu.LigerGELUMulFunction.apply(a, b),  # the tanh approximation
        "rope": lambda q, k, cos, sin: rope.LigerRopeFunction.apply(q, k, cos, sin),
        "swiglu": lambda a, b: swiglu.LigerSiLUMulFunction.apply(a, b),
        "linear_ce": lambda h, W, y: fused_linear_cross_entropy.LigerFusedLinearCrossEntropyFunction.apply(h, W, y)[0],
    }


# --- single kernels ---------------------------------------------------------------------------

def bench_copy():
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    bench("copy_2GiB", {"torch": lambda: dst.copy_(src)}, bytes_moved=2 * src.numel())


def bench_rmsnorm(liger, compile_):
    x = torch.randn(T, H, device=DEV, dtype=DT, requires_grad=True)
    w = torch.ones(H, device=DEV, dtype=DT, requires_grad=True)
    dy = torch.randn(T, H, device=DEV, dtype=DT)

    def eager(x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(DT) * w

    ours = lambda x, w: uk.rms_norm(x, w, 1e-5)  # noqa: E731
    steps = {}
    for impl, f in implementations(eager, ours, liger and liger["rmsnorm"], compile_):
        def step(f=f):
            x.grad = w.grad = None
            f(x, w).backward(dy)
        steps[impl] = step
    # read x, dy, x again; write y, dx (weight and rstd are negligible)
    bench("rmsnorm_fwd_bwd", steps, bytes_moved=5 * T * H * 2, graph=True)

    # the fused residual add: read x, r, dy, ds, s; write s, y, dx (dx doubles as d residual)
    r = torch.randn_like(x, requires_grad=True)
    ds = torch.randn_like(dy)

    def eager_res(x, r, w):
        s = x + r
        return eager(s, w), s

    def ours_res(x, r, w):
        return uk.rms_norm(x, w, 1e-5, residual=r)

    steps = {}
    for impl, f in implementations(eager_res, ours_res, liger and liger["add_rmsnorm"], compile_):
        # autograd.grad, not .backward(): x and r receive one and the same gradient tensor, and
        # accumulating it into two leaves' .grad clones it (128 MiB more traffic); in a model both
        # come from earlier ops, which take the tensor as it is.
        def step(f=f):
            torch.autograd.grad(f(x, r, w), (x, r, w), (dy, ds))
        steps[impl] = step
    bench("add_rmsnorm_fwd_bwd", steps, bytes_moved=8 * T * H * 2, graph=True)


def bench_layernorm(liger, compile_):
    x = torch.randn(T, H, device=DEV, dtype=DT, requires_grad=True)
    w = torch.ones(H, device=DEV, dtype=DT, requires_grad=True)
    b = torch.zeros(H, device=DEV, dtype=DT, requires_grad=True)
    dy = torch.randn(T, H, device=DEV, dtype=DT)
    eager = lambda x, w, b: F.layer_norm(x, (H,), w, b, 1e-5)  # noqa: E731
    steps = {}
    for impl, f in implementations(eager, uk.layer_norm, liger and liger["layernorm"], compile_):
        def step(f=f):
            x.grad = w.grad = b.grad = None
            f(x, w, b).backward(dy)
        steps[impl] = step
    bench("layernorm_fwd_bwd", steps, bytes_moved=5 * T * H * 2, graph=True)


def rope_inputs():
    """q, k (leaves that need grad), Llama-3's cos, sin (theta 500000) and the gradients dq, dk."""
    q = torch.randn(B, NH, S, HD, device=DEV, dtype=DT, requires_grad=True)
    k = torch.randn(B, NKV, S, HD, device=DEV, dtype=DT, requires_grad=True)
    inv = 1.0 / (500000 ** (torch.arange(0, HD, 2, device=DEV).float() / HD))
    freqs = torch.outer(torch.arange(S, device=DEV).float(), inv)
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().to(DT)[None], emb.sin().to(DT)[None]
    return q, k, cos, sin, torch.randn_like(q), torch.randn_like(k)


def bench_rope(liger, compile_):
    q, k, cos, sin, dq, dk = rope_inputs()

    def rotate_half(t):
        return torch.cat([-t[..., HD // 2:], t[..., : HD // 2]], -1)

    def eager(q, k, cos, sin):
        c, s = cos[:, None], sin[:, None]
        return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s

    steps = {}
    for impl, f in implementations(eager, uk.apply_rope, liger and liger["rope"], compile_):
        def step(f=f):
            q.grad = k.grad = None
            oq, ok = f(q, k, cos, sin)
            torch.autograd.backward([oq, ok], [dq, dk])
        steps[impl] = step
    # read q, k and write them, forward and backward
    bench("rope_fwd_bwd", steps, bytes_moved=4 * (q.numel() + k.numel()) * 2, graph=True)


def bench_gated(liger, compile_):
    a = torch.randn(T, I, device=DEV, dtype=DT, requires_grad=True)
    b = torch.randn(T, I, device=DEV, dtype=DT, requires_grad=True)
    dy = torch.randn(T, I, device=DEV, dtype=DT)
    nbytes = 8 * T * I * 2  # read a, b (fwd), dy, a, b (bwd); write y, da, db
    sw_eager = lambda a, b: F.silu(a) * b  # noqa: E731
    # In a model gate/up are activations, and backward reuses their buffers for the gradients
    # (Liger does the same to these leaves). A view makes them non-leaf at no GPU cost.
    sw_inplace = lambda a, b: uk.swiglu(a.view_as(a), b.view_as(b))  # noqa: E731
    ge_eager = lambda a, b: F.gelu(a, approximate="tanh") * b  # noqa: E731
    ge_ours = lambda a, b: uk.geglu(a, b, approximate="tanh")  # noqa: E731
    ge_inplace = lambda a, b: uk.geglu(a.view_as(a), b.view_as(b), approximate="tanh")  # noqa: E731
    for op, impls in [
        ("swiglu_fwd_bwd", implementations(sw_eager, uk.swiglu, liger and liger["swiglu"], compile_)
         + [("unsloth_kernels_inplace", sw_inplace)]),
        ("geglu_tanh_fwd_bwd", implementations(ge_eager, ge_ours, liger and liger["geglu"], compile_)
         + [("unsloth_kernels_inplace", ge_inplace)]),
    ]:
        steps = {}
        for impl, f in impls:
            def step(f=f):
                a.grad = b.grad = None
                f(a, b).backward(dy)
            steps[impl] = step
        bench(op, steps, bytes_moved=nbytes)


# --- helper F's kernels: each section runs when its function exists ---------------------------

def bench_linear_ce(liger, compile_):
    h = torch.randn(T, H, device=DEV, dtype=DT, requires_grad=True)
    W = torch.randn(V, H, device=DEV, dtype=DT) * 0.02
    y = torch.randint(0, V, (T,), device=DEV)
    y[::7] = -100
    eager = lambda h, W, y: F.cross_entropy((h @ W.t()).float(), y, ignore_index=-100)  # noqa: E731
    ours = getattr(uk, "fused_linear_cross_entropy", None)
    impls = [("eager", eager)] + ([("compile", torch.compile(eager))] if compile_ else [])
    impls += [("liger_flce", liger["linear_ce"])] if liger else []
    impls += [("unsloth_kernels", ours)] if ours else []
    if ours:
        # Rows per chunk trade GEMM efficiency (small M) against memory; the default keeps one
        # chunk of bf16 logits <= 128 MiB (512 rows here). The sweep shows what a larger one buys.
        from unsloth_kernels.cross_entropy import chunk_rows

        default = chunk_rows(T, V, 2)
        impls += [(f"unsloth_kernels chunk={c}", functools.partial(ours, chunk_size=c))
                  for c in (256, 1024, 2048) if c != default]  # fmt: skip
    steps = {}
    for impl, f in impls:
        def step(f=f):
            h.grad = None
            f(h, W, y).backward()
        steps[impl] = step
    bench("linear_ce_fwd_bwd", steps, flops=2 * 2 * T * H * V)  # forward logits + dX


def bench_nf4():
    dequantize = getattr(uk, "dequantize_nf4", None)
    if dequantize is None:
        return
    from unsloth_kernels.nf4 import NestedAbsmax, dequantize_prepared, prepare_4bit

    try:
        import bitsandbytes.functional as bnbf  # the reference, when the bench machine has it
    except ImportError:
        bnbf = None
    for rows, cols in [(I, H), (H, H)]:
        n = rows * cols
        op = f"nf4_dequant_{rows}x{cols}"
        # Random bytes and scales are as good as a real weight for timing; nested (double) quant.
        packed = torch.randint(0, 256, (n // 2,), dtype=torch.uint8, device=DEV)
        absmax = torch.randint(0, 256, (n // 64,), dtype=torch.uint8, device=DEV)
        nested = NestedAbsmax(absmax=torch.rand(triton.cdiv(n // 64, 256), device=DEV),
                              code=torch.linspace(-1, 1, 256, device=DEV), blocksize=256, offset=0.1)
        out = torch.empty(rows, cols, dtype=DT, device=DEV)
        nbytes = n // 2 + n // 64 + 2 * n  # packed + absmax read, bf16 written
        # A copy moving as many bytes: what the copy rate is at this size (launch, ramp and tail
        # weigh on a 10 µs transfer, and the 2 GiB copy's rate hides them).
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device=DEV)
        dst = torch.empty_like(src)
        # The trainer's path: each frozen weight prepared once, then one launch per dequantization.
        prepared = prepare_4bit(packed, absmax, (rows, cols), nested=nested)
        steps = {
            SIZE_COPY: lambda: dst.copy_(src),
            "unsloth_kernels": lambda: dequantize_prepared(prepared, DT, out),
            "unsloth_kernels, unprepared": lambda: dequantize(packed, absmax, (rows, cols), DT, nested=nested, out=out),
        }
        if bnbf is not None:
            w = torch.randn(rows, cols, device=DEV, dtype=DT)
            q, state = bnbf.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
            steps["bitsandbytes"] = lambda: bnbf.dequantize_4bit(q, state, out=out)
        bench(op, steps, bytes_moved=nbytes, graph=True)


def bench_lora_mlp():
    lora_mlp = getattr(uk, "lora_mlp", None)
    if lora_mlp is None:
        return
    from unsloth_kernels import LoraWeights

    def adapter(out_f, in_f):
        W = torch.randn(out_f, in_f, device=DEV, dtype=DT) * 0.02
        A = (torch.randn(RANK, in_f, device=DEV, dtype=DT) * 0.02).requires_grad_()
        Bm = (torch.randn(out_f, RANK, device=DEV, dtype=DT) * 0.02).requires_grad_()
        return LoraWeights(W, A, Bm, 2.0)

    gate, up, down = adapter(I, H), adapter(I, H), adapter(H, I)
    x = torch.randn(T, H, device=DEV, dtype=DT, requires_grad=True)
    dy = torch.randn(T, H, device=DEV, dtype=DT)

    def lin(x, p):
        return x @ p.weight.t() + p.scaling * ((x @ p.A.t()) @ p.B.t())

    def eager(x):  # what PEFT computes for a LoRA LlamaMLP
        return lin(F.silu(lin(x, gate)) * lin(x, up), down)

    def nf4(p):  # QLoRA: the same adapter on a 4-bit base (random bytes time like a real weight)
        from types import SimpleNamespace

        from unsloth_kernels.nf4 import NF4_CODE

        n = p.weight.numel()
        state2 = SimpleNamespace(absmax=torch.rand(triton.cdiv(n // 64, 256), device=DEV),
                                 code=torch.linspace(-1, 1, 256, device=DEV), blocksize=256)
        state = SimpleNamespace(absmax=torch.randint(0, 256, (n // 64,), dtype=torch.uint8, device=DEV),
                                shape=p.weight.shape, dtype=DT, blocksize=64, quant_type="nf4",
                                code=torch.tensor(NF4_CODE, device=DEV), offset=0.0, state2=state2)
        packed = torch.randint(0, 256, (n // 2, 1), dtype=torch.uint8, device=DEV)
        return LoraWeights(packed, p.A, p.B, p.scaling, quant_state=state)  # fmt: skip

    q_gate, q_up, q_down = nf4(gate), nf4(up), nf4(down)
    params = [p for a in (gate, up, down) for p in (a.A, a.B)]
    flops = 6 * 2 * T * H * I  # base GEMMs: 3 forward + 3 for dX (frozen base); LoRA side is ~1%
    steps = {}
    for impl, f in [("eager", eager), ("unsloth_kernels", lambda x: lora_mlp(x, gate, up, down)),
                    ("unsloth_kernels nf4 base", lambda x: lora_mlp(x, q_gate, q_up, q_down))]:  # fmt: skip
        def step(f=f):
            x.grad = None
            for p in params:
                p.grad = None
            f(x).backward(dy)
        steps[impl] = step
    bench("lora_mlp_fwd_bwd", steps, flops=flops)


# --- report -------------------------------------------------------------------------------------

SECTIONS = ("rmsnorm", "layernorm", "rope", "swiglu", "linear_ce", "nf4", "lora_mlp")


def report():
    copy_gbps = next((r["GBps"] for r in ROWS if r["op"] == "copy_2GiB"), None)
    # Where an op also times a copy of its own size (NF4), the floor at that size: launch, ramp
    # and tail weigh on a transfer of a few µs, and the 2 GiB copy's rate hides them.
    size_copy_ms = {r["op"]: r["ms"] for r in ROWS if r["impl"] == SIZE_COPY}
    lines = ["| op | impl | ms | graph ms | peak GiB | GB/s | % of copy | floor ms | x floor | x same-size copy | TFLOP/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in ROWS:
        if copy_gbps and "bytes" in r:
            floor = r["bytes"] / copy_gbps / 1e6
            r["floor_ms"], r["x_floor"] = round(floor, 4), round(r["ms"] / floor, 2)
            r["pct_copy"] = round(100 * r["GBps"] / copy_gbps, 1)
        if r["op"] in size_copy_ms:
            r["x_size_copy"] = round(r["ms"] / size_copy_ms[r["op"]], 2)
        cells = [r["op"], r["impl"], r["ms"], r.get("graph_ms") or "", r["peak_gib"], r.get("GBps", ""), r.get("pct_copy", ""),
                 r.get("floor_ms", ""), r.get("x_floor", ""), r.get("x_size_copy", ""), r.get("TFLOPs", "")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    print("\n".join(lines))
    print(json.dumps({"bench": "unsloth_kernels", "device": torch.cuda.get_device_name(),
                      "torch": torch.__version__, "triton": triton.__version__, "copy_GBps": copy_gbps,
                      "rows": ROWS}))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows (saves minutes)")
    parser.add_argument("--no-liger", action="store_true", help="skip Liger even when it is installed")
    args = parser.parse_args(argv)
    only = set(args.only.split(","))
    unknown = only - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    if not torch.cuda.is_available():
        print("bench_kernels: needs a GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    liger = None if args.no_liger else liger_ops()
    compile_ = not args.no_compile
    bench_copy()
    runs = {
        "rmsnorm": lambda: bench_rmsnorm(liger, compile_),
        "layernorm": lambda: bench_layernorm(liger, compile_),
        "rope": lambda: bench_rope(liger, compile_),
        "swiglu": lambda: bench_gated(liger, compile_),
        "linear_ce": lambda: bench_linear_ce(liger, compile_),
        "nf4": bench_nf4,
        "lora_mlp": bench_lora_mlp,
    }
    for name in SECTIONS:
        if name in only:
            runs[name]()
            torch.cuda.empty_cache()
    report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
