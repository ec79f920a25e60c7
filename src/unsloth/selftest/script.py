"""The self-test: checks that run inside an environment's own Python and print one JSON line per check.

unsloth.selftest.run copies this file to a temporary folder and runs it with the managed
environment's interpreter (`python selftest.py --backend cuda`), so one interpreter start
covers every check and a hang costs one timeout. It uses only the standard library at
import, because it must report, not crash, when torch or anything else is broken.

Each line: {"check": name, "ok": true|false|null, "message": "...", "seconds": s, ...facts}.
ok is null when the check could not run (torch missing for the matmul, no GPU for Triton).
Lines come in the order of CHECKS; whatever is missing after a timeout is what hung.
"""

import argparse
import json
import os
import sys
import time
import traceback

CHECKS = ("torch", "gpu", "matmul", "bitsandbytes", "triton", "llama_cpp")
GPU_BACKENDS = ("cuda", "rocm")


class Skip(Exception):
    """The check cannot run here; the message says why."""


def emit(check, ok, message, **facts):
    print(json.dumps({"check": check, "ok": ok, "message": message, **facts}, default=str), flush=True)


def build_backend(torch):
    if getattr(torch.version, "hip", None):
        return "rocm"
    if torch.version.cuda:
        return "cuda"
    if getattr(torch, "xpu", None) is not None and torch.xpu.is_available():
        return "xpu"
    return "cpu"


def check_torch(state):
    import torch

    state["torch"] = torch
    backend = build_backend(torch)
    return True, "torch %s (%s build)" % (torch.__version__, backend), {
        "version": torch.__version__,
        "backend": backend,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
    }


def check_gpu(state):
    torch = need_torch(state)
    if not torch.cuda.is_available():
        state["device"] = "cpu"
        return False, "torch sees no GPU", {"count": 0, "devices": []}
    devices = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        arch = getattr(props, "gcnArchName", None) or "sm_%d%d" % (props.major, props.minor)
        devices.append({
            "index": index,
            "name": props.name,
            "arch": arch.split(":")[0],  # "gfx1100:sramecc-:xnack-" -> "gfx1100"
            "capability": "%d.%d" % (props.major, props.minor),
            "vram_bytes": props.total_memory,
        })
    state["device"] = "cuda:0"
    first = devices[0]
    return True, "%s (%s), %d GPU(s)" % (first["name"], first["arch"], len(devices)), {
        "count": len(devices), "devices": devices,
    }


def check_matmul(state):
    torch = need_torch(state)
    device = state.get("device", "cpu")
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(256, 256, generator=generator)
    b = torch.randn(256, 256, generator=generator)
    start = time.monotonic()
    product = (a.to(device) @ b.to(device)).cpu()
    if device != "cpu":
        torch.cuda.synchronize()
    elapsed = time.monotonic() - start
    exact = a.double() @ b.double()
    error = ((product.double() - exact).abs().max() / exact.abs().max()).item()
    ok = error < 1e-2  # float32 gives ~1e-7, TF32 ~1e-3; a broken kernel gives garbage
    return ok, "256x256 matmul on %s, max relative error %.1e" % (device, error), {
        "device": device, "error": error, "ms": round(elapsed * 1000, 2),
    }


def check_bitsandbytes(state):
    torch = need_torch(state)
    import bitsandbytes
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    device = state.get("device", "cpu")
    x = torch.randn(128, 128, generator=torch.Generator().manual_seed(0)).to(device)
    packed, quant_state = quantize_4bit(x, quant_type="nf4")
    restored = dequantize_4bit(packed, quant_state).float()
    error = ((restored - x).abs().mean() / x.abs().mean()).item()
    ok = error < 0.2  # NF4 keeps ~10% mean relative error on Gaussian data
    return ok, "bitsandbytes %s NF4 round trip on %s, mean relative error %.3f" % (
        bitsandbytes.__version__, device, error), {"version": bitsandbytes.__version__, "error": error}


def check_triton(state):
    torch = need_torch(state)
    device = state.get("device", "cpu")
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise Skip("no GPU for Triton (TRITON_INTERPRET=1 runs it on the CPU)")
    import triton
    import triton.language as tl

    @triton.jit
    def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + tl.load(y_ptr + offsets, mask=mask), mask=mask)

    x = torch.randn(1000, device=device)
    y = torch.randn(1000, device=device)
    out = torch.empty_like(x)
    add_kernel[(triton.cdiv(1000, 256),)](x, y, out, 1000, BLOCK=256)
    ok = bool(torch.equal(out, x + y))
    mode = "interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else device
    return ok, "Triton %s compiled and ran a kernel (%s)" % (triton.__version__, mode), {
        "version": triton.__version__, "mode": mode,
    }


def check_llama_cpp(state):
    import llama_cpp  # loads the shared library: a wrong build fails here

    offload = bool(llama_cpp.llama_supports_gpu_offload())
    return True, "llama-cpp-python %s (GPU offload: %s)" % (llama_cpp.__version__, "yes" if offload else "no"), {
        "version": llama_cpp.__version__, "gpu_offload": offload,
    }


def need_torch(state):
    if "torch" not in state:
        raise Skip("torch did not import")
    return state["torch"]


def run(name, check, state):
    start = time.monotonic()
    try:
        ok, message, facts = check(state)
    except Skip as skip:
        ok, message, facts = None, str(skip), {}
    except BaseException as exc:  # noqa: BLE001 - a broken package must become a report, not a crash
        if isinstance(exc, KeyboardInterrupt):
            raise
        ok, message = False, ("%s: %s" % (type(exc).__name__, exc)).strip().splitlines()[0]
        facts = {"traceback": traceback.format_exc(limit=4)}
    emit(name, ok, message, seconds=round(time.monotonic() - start, 3), **facts)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="cpu", help="the plan's torch backend: cuda, rocm, cpu, ...")
    args = parser.parse_args(argv)
    if args.backend not in GPU_BACKENDS:
        # Without a GPU, Triton can still prove it works through its interpreter.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    emit("python", True, sys.version.split()[0], executable=sys.executable)
    state = {}
    for name in CHECKS:
        run(name, globals()["check_" + name], state)
    return 0


if __name__ == "__main__":
    sys.exit(main())
