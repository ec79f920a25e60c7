"""Sweep the launch parameters of the memory-bound kernels on a GPU, and split each op's time.

For each op: the kernels alone under a sweep of their tunables (module state in unsloth_kernels,
see _utils.NORM_TUNING), then the whole forward+backward step three ways: do_bench as
bench_kernels.py measures it, the same step replayed from a CUDA graph (GPU time alone), and the
host time to issue one step (launch overhead). If the step is far above its graph replay, the host
is the bottleneck, not the kernels. Llama-3.1-8B shapes, bf16. Prints one JSON line per result.

    python bench/tune_kernels.py [--only rmsnorm,layernorm,rope,nf4,ce]
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import time

import torch
import triton

import unsloth_kernels as uk
from bench_kernels import B, DEV, DT, H, HD, NH, NKV, S, T, V, graph_ms, rope_inputs  # its shapes, timing
from profiling import host_us
from unsloth_kernels import _utils

rms = importlib.import_module("unsloth_kernels.rms_norm")
ln = importlib.import_module("unsloth_kernels.layer_norm")
rope = importlib.import_module("unsloth_kernels.rope")
nf4 = importlib.import_module("unsloth_kernels.nf4")
ce = importlib.import_module("unsloth_kernels.cross_entropy")


def emit(**row):
    print(json.dumps(row), flush=True)


def gpu_ms(fn, rep=40):
    return round(triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median"), 4)


def step_report(op, step, n=50):
    emit(op=op, what="step", do_bench_ms=gpu_ms(step), graph_ms=graph_ms(step), host_us=host_us(step, n))


def sweep(op, direction, configs, fn, check=None):
    best = None
    ref = None
    for cfg in configs:
        _utils.NORM_TUNING[direction].update(cfg)
        try:
            out = fn()
            err = None
            if check is not None:
                ref = out if ref is None else ref
                err = check(out, ref)
            ms = gpu_ms(fn)
        except Exception as e:  # noqa: BLE001
            emit(op=op, direction=direction, cfg=cfg, error=f"{type(e).__name__}: {str(e)[:200]}")
            continue
        emit(op=op, direction=direction, cfg=cfg, ms=ms, err=err)
        if best is None or ms < best[0]:
            best = (ms, dict(cfg))
    emit(op=op, direction=direction, best=best)
    _utils.NORM_TUNING[direction].update(best[1])
    return best


def maxdiff(a, b):
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b) if x is not None)


FWD = [{"tile": t, "warps": w} for t, w in itertools.product((4096, 8192), (4, 8, 16))] + [{"tile": 16384, "warps": 16}]
BWD = [{"tile": t, "warps": w, "programs_per_sm": p}
       for t, w, p in itertools.product((4096, 8192), (8, 16), (2, 4, 8, 16))] + [
       {"tile": 4096, "warps": 4, "programs_per_sm": p} for p in (8, 16)]  # fmt: skip


def tune_rmsnorm():
    x = torch.randn(T, H, device=DEV, dtype=DT, requires_grad=True)
    w = (1 + 0.1 * torch.randn(H, device=DEV)).to(DT).requires_grad_()
    dy = torch.randn(T, H, device=DEV, dtype=DT)

    def step():
        x.grad = w.grad = None
        uk.rms_norm(x, w, 1e-5).backward(dy)

    step_report("rmsnorm", step)
    sweep("rmsnorm", "forward", FWD, lambda: rms.rms_norm_forward(x.detach(), w.detach(), 1e-5, 0.0, None, "llama"))
    _, x2, rstd = rms.rms_norm_forward(x.detach(), w.detach(), 1e-5, 0.0, None, "llama")
    sweep("rmsnorm", "backward", BWD,
          lambda: rms.rms_norm_backward(dy, None, x2, w.detach(), rstd, 0.0, "llama", DT), check=maxdiff)
    step_report("rmsnorm tuned", step)
    r = torch.randn_like(x, requires_grad=True)
    ds = torch.randn_like(dy)

    def step_res():  # autograd.grad: two leaves' .grad would clone the shared gradient
        torch.autograd.grad(uk.rms_norm(x, w, 1e-5, residual=r), (x, r, w), (dy, ds))

    step_report("add_rmsnorm tuned", step_res)
    _, s2, rstd = rms.rms_norm_forward(x.detach(), w.detach(), 1e-5, 0.0, r.detach(), "llama")
    sweep("add_rmsnorm", "backward", BWD,
          lambda: rms.rms_norm_backward(dy, ds, s2, w.detach(), rstd, 0.0, "llama", DT), check=maxdiff)
    step_report("add_rmsnorm retuned", step_res)


def tune_layernorm():
    x = torch.randn(T, H, device=DEV, dtype=DT, requires_grad=True)
    w = (1 + 0.1 * torch.randn(H, device=DEV)).to(DT).requires_grad_()
    b = (0.1 * torch.randn(H, device=DEV)).to(DT).requires_grad_()
    dy = torch.randn(T, H, device=DEV, dtype=DT)

    def step():
        x.grad = w.grad = b.grad = None
        uk.layer_norm(x, w, b).backward(dy)

    def eager():
        x.grad = w.grad = b.grad = None
        torch.nn.functional.layer_norm(x, (H,), w, b, 1e-5).backward(dy)

    step_report("layernorm eager", eager)
    step_report("layernorm", step)
    sweep("layernorm", "forward", FWD, lambda: ln.layer_norm_forward(x.detach(), w.detach(), b.detach(), 1e-5))
    _, x2, mean, rstd = ln.layer_norm_forward(x.detach(), w.detach(), b.detach(), 1e-5)
    sweep("layernorm", "backward", BWD,
          lambda: ln.layer_norm_backward(dy, x2, w.detach(), b.detach(), mean, rstd), check=maxdiff)
    step_report("layernorm tuned", step)


def tune_rope():
    q, k, cos, sin, dq, dk = rope_inputs()

    def step():
        q.grad = k.grad = None
        torch.autograd.backward(list(uk.apply_rope(q, k, cos, sin)), [dq, dk])

    step_report("rope", step)
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    # HF's layout: (B, S, heads * hd) projections viewed as (B, heads, S, hd)
    qt = torch.randn(B, S, NH * HD, device=DEV, dtype=DT).view(B, S, NH, HD).transpose(1, 2)
    kt = torch.randn(B, S, NKV * HD, device=DEV, dtype=DT).view(B, S, NKV, HD).transpose(1, 2)
    qto, kto = torch.empty_like(qt), torch.empty_like(kt)
    emit(op="rope kernel", ms_contiguous=gpu_ms(lambda: rope.rope_launch(q.detach(), k.detach(), qo, ko, cos, sin, None, False)),
         ms_hf_layout=gpu_ms(lambda: rope.rope_launch(qt, kt, qto, kto, cos, sin, None, False)))


def tune_nf4():
    try:
        import bitsandbytes.functional as bnbf
    except Exception:  # noqa: BLE001
        bnbf = None
    results = {}
    for rows, cols in [(14336, H), (H, H)]:
        n = rows * cols
        packed = torch.randint(0, 256, (n // 2,), dtype=torch.uint8, device=DEV)
        absmax = torch.randint(0, 256, (n // 64,), dtype=torch.uint8, device=DEV)
        nested = nf4.NestedAbsmax(absmax=torch.rand(triton.cdiv(n // 64, 256), device=DEV),
                                  code=torch.linspace(-1, 1, 256, device=DEV), blocksize=256, offset=0.1)
        out = torch.empty(rows, cols, dtype=DT, device=DEV)
        call = lambda: uk.dequantize_nf4(packed, absmax, (rows, cols), DT, nested=nested, out=out)  # noqa: E731
        prepared = nf4.prepare_4bit(packed, absmax, (rows, cols), nested=nested)
        launch = lambda: nf4.dequantize_prepared(prepared, DT, out)  # noqa: E731 - the trainer's path
        ref = call().clone()
        configs = ((512, 2), (1024, 2), (1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8))
        for (nbytes, warps), row in itertools.product(configs, (8, 16, 32)):
            nf4._BYTES_PER_PROGRAM, nf4._WARPS, nf4._ROW_BYTES = nbytes, warps, row
            same = bool(torch.equal(launch(), ref))
            ms = gpu_ms(launch, rep=100)
            results.setdefault((nbytes, warps, row), []).append(ms)
            emit(op=f"nf4 {rows}x{cols}", bytes=nbytes, warps=warps, row=row, ms=ms, graph_ms=graph_ms(launch), same=same)
        emit(op=f"nf4 {rows}x{cols}", host_us_unprepared=host_us(call), host_us_prepared=host_us(launch))
        if bnbf is not None:
            w = torch.randn(rows, cols, device=DEV, dtype=DT)
            qw, state = bnbf.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
            emit(op=f"nf4 {rows}x{cols}", impl="bitsandbytes", ms=gpu_ms(lambda: bnbf.dequantize_4bit(qw, state, out=out), rep=100))
            mine = uk.dequantize_bnb_4bit(qw, state)
            emit(op=f"nf4 {rows}x{cols}", impl="ours on bnb state", ms=gpu_ms(lambda: uk.dequantize_bnb_4bit(qw, state, out=out), rep=100),
                 equal_to_bnb=bool(torch.equal(mine, bnbf.dequantize_4bit(qw, state))))
    best = min(results.items(), key=lambda kv: sum(kv[1]))
    nf4._BYTES_PER_PROGRAM, nf4._WARPS, nf4._ROW_BYTES = best[0]
    emit(op="nf4", best=best)


def tune_ce():
    h = torch.randn(T, H, device=DEV, dtype=DT, requires_grad=True)
    W = torch.randn(V, H, device=DEV, dtype=DT) * 0.02
    y = torch.randint(0, V, (T,), device=DEV)
    y[::7] = -100

    def step(chunk=None):
        h.grad = None
        uk.fused_linear_cross_entropy(h, W, y, chunk_size=chunk).backward()

    step_report("flce", step, 5)
    for rows in (256, 512, 1024):
        x = h.detach()[:rows]
        logits = torch.empty(rows, V, dtype=DT, device=DEV)
        dx = torch.empty(rows, H, dtype=DT, device=DEV)
        g1 = gpu_ms(lambda: torch.mm(x, W.t(), out=logits))
        g2 = gpu_ms(lambda: torch.mm(logits, W, out=dx))
        emit(op="flce parts", rows=rows, gemm_logits_ms=g1, gemm_dx_ms=g2,
             tflops_logits=round(2 * rows * H * V / g1 / 1e9, 1), tflops_dx=round(2 * rows * H * V / g2 / 1e9, 1),
             total_gemm_ms_all_chunks=round((g1 + g2) * T / rows, 2))
    rows = 512
    logits = torch.randn(rows, V, dtype=DT, device=DEV) * 2
    losses = torch.empty(rows, dtype=torch.float32, device=DEV)
    logits0 = logits.clone()
    lf = logits0.float().requires_grad_()
    expected = torch.nn.functional.cross_entropy(lf, y[:rows], ignore_index=-100, reduction="none")
    expected.sum().backward()
    expected, expected_grad = expected.detach(), lf.grad
    best = None
    for warps, block_v in [(8, 8192), (16, 8192), (32, 16384), (16, 16384)]:
        def kernel(t=logits):
            ce._cross_entropy_rows_kernel[(rows,)](
                t, t.stride(0), y[:rows], losses, V, -100, 0.0, 1.0,
                HAS_SCALE=False, HAS_SOFTCAP=False, COMPUTE_GRAD=True, BLOCK_V=block_v, num_warps=warps)
        try:
            fresh = logits0.clone()
            kernel(fresh)
            emit(op="ce kernel", warps=warps, block_v=block_v, loss_err=float((losses - expected).abs().max()),
                 grad_err=float((fresh.float() - expected_grad).abs().max()))
            ms = gpu_ms(kernel)
        except Exception as e:  # noqa: BLE001
            emit(op="ce kernel", warps=warps, block_v=block_v, error=str(e)[:200])
            continue
        emit(op="ce kernel", rows=rows, warps=warps, block_v=block_v, ms=ms,
             GBps=round(3 * rows * V * 2 / ms / 1e6, 1), all_chunks_ms=round(ms * T / rows, 2))
        if best is None or ms < best[0]:
            best = (ms, warps, block_v)
    emit(op="ce kernel", best=best)
    _, ce._CE_WARPS, ce._MAX_BLOCK_V = best
    step_report("flce tuned", step, 5)
    step_report("flce tuned chunk=1024", lambda: step(1024), 5)


def tune_host():
    """Where the host time of an RMSNorm step goes: autograd, our launcher, a bare launch; then a
    launch's parts and a LayerNorm step's (below)."""
    x = torch.randn(T, H, device=DEV, dtype=DT, requires_grad=True)
    w = torch.ones(H, device=DEV, dtype=DT, requires_grad=True)
    dy = torch.randn(T, H, device=DEV, dtype=DT)

    class Trivial(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return torch.empty_like(x)

        @staticmethod
        def backward(ctx, dy):
            return torch.empty_like(dy), torch.empty_like(ctx.saved_tensors[1])

    def trivial():
        x.grad = w.grad = None
        Trivial.apply(x, w).backward(dy)

    def ours():
        x.grad = w.grad = None
        uk.rms_norm(x, w, 1e-5).backward(dy)

    xd, wd = x.detach(), w.detach()
    y = torch.empty_like(xd)
    rstd = torch.empty(T, device=DEV)

    def bare_launch():
        rms._rms_norm_fwd[(T // 2,)](xd, xd, y, wd, y, rstd, T, H, 1e-5, 0.0, H, 0, 0, H,
                                    HAS_RESIDUAL=False, LLAMA_CAST=True, BLOCK_M=2, BLOCK_N=H, num_warps=16)

    rows = {"trivial autograd fn": trivial, "ours rms step": ours,
            "ours rms forward, no autograd": lambda: rms.rms_norm_forward(xd, wd, 1e-5, 0.0, None, "llama"),
            "bare launch, direct (rms fwd)": bare_launch, "torch.empty": lambda: torch.empty(T, device=DEV)}
    try:
        from liger_kernel.ops import rms_norm as liger

        def liger_step():
            x.grad = w.grad = None
            liger.LigerRMSNormFunction.apply(x, w, 1e-5, 0.0, "llama", False).backward(dy)

        yl, rl = torch.empty_like(xd), torch.empty(T, device=DEV)

        def liger_launch():
            liger._rms_norm_forward_kernel[(T,)](yl, H, xd, H, wd, 1, rl, 1, H, 1e-5, 0.0, 1,
                                                 elementwise_affine=True, BLOCK_SIZE=H, num_warps=8)
        rows.update({"liger rms step": liger_step, "bare triton launch (liger rms fwd)": liger_launch})
    except Exception as e:  # noqa: BLE001
        emit(section="host", liger=str(e)[:200])
    for name, fn in rows.items():
        emit(op="host", what=name, host_us=host_us(fn, 100))
    tune_launch_path()
    tune_layernorm_host()


def tune_launch_path():
    """Where a Triton launch's host time goes: Triton's entry point against its parts (argument
    binding and specialization, cache key, current stream, the compiled kernel's own launcher) and
    against our direct launch (_launch.py). One-program grids, so the GPU never holds the host back."""
    from triton.runtime.driver import driver
    from triton.runtime.jit import compute_cache_key

    x = torch.randn(2, H, device=DEV, dtype=DT)
    w = torch.ones(H, device=DEV, dtype=DT)
    y, rstd, mean = torch.empty_like(x), torch.empty(2, device=DEV), torch.empty(2, device=DEV)
    launches = {
        "ours rms fwd": (rms._rms_norm_fwd, (1,), (x, x, y, w, y, rstd, 2, H, 1e-5, 0.0, H, 0, 0, H),
                         dict(HAS_RESIDUAL=False, LLAMA_CAST=True, BLOCK_M=2, BLOCK_N=H, num_warps=16)),
        "ours layernorm fwd": (ln._layer_norm_fwd, (1,), (x, w, w, y, mean, rstd, 2, H, 1e-5, H, H),
                               dict(HAS_BIAS=True, BLOCK_M=2, BLOCK_N=H, num_warps=16)),
    }
    dev = driver.active.get_current_device()
    for name, (kernel, grid, args, kwargs) in launches.items():
        jit = getattr(kernel, "kernel", kernel)  # the JITFunction under our direct launch
        compiled = jit[grid](*args, **kwargs)
        _, key_cache, _, _, binder = jit.device_caches[dev]
        options = dict(kwargs, debug=False, instrumentation_mode="")
        bound, spec, opts = binder(*args, **options)
        everything = tuple(bound.values())
        stream = driver.active.get_current_stream(dev)
        parts = {
            "triton launch": lambda: jit[grid](*args, **kwargs),
            "direct launch (ours)": lambda: kernel[grid](*args, **kwargs),
            "binder": lambda: binder(*args, **options),
            "cache key": lambda: compute_cache_key(key_cache, spec, opts),
            "device + stream": lambda: driver.active.get_current_stream(driver.active.get_current_device()),
            "compiled run": lambda: compiled.run(grid[0], 1, 1, stream, compiled.function, compiled.packed_metadata,
                                                 None, None, None, *everything),
        }
        for part, fn in parts.items():
            emit(op="launch", kernel=name, part=part, host_us=host_us(fn, 200), args=len(args))


def tune_layernorm_host():
    """A LayerNorm step's host time in parts, with eager's; frozen weight and bias leave out the
    partial sums' kernel, three allocations and two gradient accumulations."""
    x = torch.randn(T, H, device=DEV, dtype=DT, requires_grad=True)
    w = torch.ones(H, device=DEV, dtype=DT, requires_grad=True)
    b = torch.zeros(H, device=DEV, dtype=DT, requires_grad=True)
    w_frozen, b_frozen = w.detach().clone(), b.detach().clone()
    dy = torch.randn(T, H, device=DEV, dtype=DT)
    xd, wd, bd = x.detach(), w.detach(), b.detach()
    _, x2, mean, rstd = ln.layer_norm_forward(xd, wd, bd, 1e-5)

    def step(f):
        def run():
            x.grad = w.grad = b.grad = None
            f(x, w, b).backward(dy)
        return run

    rows = {
        "eager step": step(lambda x, w, b: torch.nn.functional.layer_norm(x, (H,), w, b, 1e-5)),
        "ours step": step(uk.layer_norm),
        "ours step, no bias": step(lambda x, w, b: uk.layer_norm(x, w)),
        "ours step, frozen weight and bias": step(lambda x, w, b: uk.layer_norm(x, w_frozen, b_frozen)),
        "ours forward, no autograd": lambda: ln.layer_norm_forward(xd, wd, bd, 1e-5),
        "ours backward, no autograd": lambda: ln.layer_norm_backward(dy, x2, wd, bd, mean, rstd),
        "7 torch.empty": lambda: [torch.empty(T, device=DEV) for _ in range(7)],
    }
    for name, fn in rows.items():
        emit(op="layernorm host", what=name, host_us=host_us(fn, 100))


SECTIONS = {"rmsnorm": tune_rmsnorm, "rope": tune_rope, "ce": tune_ce, "nf4": tune_nf4, "layernorm": tune_layernorm,
            "host": tune_host}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default=",".join(SECTIONS))
    args = parser.parse_args()
    torch.manual_seed(0)
    for name in args.only.split(","):
        t0 = time.time()
        try:
            SECTIONS[name]()
        except Exception as e:  # noqa: BLE001 - keep the other sections
            emit(section=name, error=f"{type(e).__name__}: {str(e)[:300]}")
        emit(section=name, seconds=round(time.time() - t0, 1))
        torch.cuda.empty_cache()
    emit(final_tuning=_utils.NORM_TUNING, nf4=(nf4._BYTES_PER_PROGRAM, nf4._WARPS, nf4._ROW_BYTES), ce=(ce._CE_WARPS, ce._MAX_BLOCK_V))


if __name__ == "__main__":
    main()
