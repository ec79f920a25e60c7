"""The self-test: checks that run inside an environment's own Python and print one JSON line per check.

unsloth.selftest.run copies this file to a temporary folder and runs it with the managed
environment's interpreter (`python selftest.py --backend cuda`), so one interpreter start
covers every check and a hang costs one timeout. It uses only the standard library at
import, because it must report, not crash, when torch or anything else is broken.

Each line: {"check": name, "ok": true|false|null, "message": "...", "seconds": s, ...facts}.
ok is null when the check could not run (torch missing for the matmul, no GPU for Triton).
Lines come in the order of CHECKS; whatever is missing after a timeout is what hung.

`unsloth install` runs it too, to verify a new environment (`--only torch --imports unsloth ...`):
then it also prints an "imports" line (each module's import status) and a "packages" line (every
installed distribution's version).
"""

import argparse
import importlib
import importlib.metadata
import json
import os
import sys
import time
import traceback

# multi_gpu last: a broken peer-to-peer link can hang its copy, and a hang only hides what comes after.
CHECKS = ("torch", "gpu", "matmul", "bitsandbytes", "triton", "fla", "llama_cpp", "multi_gpu")
# Checks of opt-in parts (`unsloth install --with PART`): run only when asked (`--with vllm`), in this order.
OPT_IN_CHECKS = ("vllm",)
ORDER = ("torch", "gpu", "matmul", "bitsandbytes", "triton", "fla", "llama_cpp", "vllm", "multi_gpu")
GPU_BACKENDS = ("cuda", "rocm")
# What an install verifies imports (the plan decides which of them must).
IMPORTS = ("unsloth", "transformers", "peft", "trl", "accelerate", "datasets", "bitsandbytes", "gguf", "llama_cpp",
           "vllm", "fla")


def checks_with(opt_in):
    """The checks a run reports, in order: every default one, and the opt-in ones named."""
    return tuple(name for name in ORDER if name not in OPT_IN_CHECKS or name in opt_in)


class Skip(Exception):
    """The check cannot run here; the message says why."""


def emit(check, ok, message, **facts):
    print(json.dumps({"check": check, "ok": ok, "message": message, **facts}, default=str), flush=True)


def torch_backend(torch_info):
    """The backend a torch build was made for, from its version fields: the one answer to
    "which backend is this torch" (the install's verification and doctor both ask it)."""
    if torch_info.get("hip"):
        return "rocm"
    if torch_info.get("cuda"):
        return "cuda"
    if "+xpu" in (torch_info.get("version") or ""):
        return "xpu"
    return "cpu"


def check_torch(state):
    import torch

    state["torch"] = torch
    facts = {"version": torch.__version__, "cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None)}
    backend = torch_backend(facts)
    cuda = bool(torch.cuda.is_available())  # true on ROCm builds too
    xpu = bool(getattr(torch, "xpu", None) and torch.xpu.is_available())
    mps = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    return True, "torch %s (%s build)" % (torch.__version__, backend), dict(
        facts, backend=backend, gpu_seen=cuda or xpu or mps, device_name=torch.cuda.get_device_name(0) if cuda else None)


def report_imports(modules):
    status = {}
    for name in modules:
        try:
            importlib.import_module(name)
            status[name] = "ok"
        except BaseException as exc:  # noqa: BLE001 - a broken package must become a report, not a crash
            if isinstance(exc, KeyboardInterrupt):
                raise
            status[name] = "%s: %s" % (type(exc).__name__, exc)
    broken = [name for name in modules if status[name] != "ok"]
    emit("imports", not broken, "broken: " + ", ".join(broken) if broken else "%d modules import" % len(modules),
         modules=status)
    versions = {dist.metadata["Name"].lower(): dist.version
                for dist in importlib.metadata.distributions() if dist.metadata["Name"]}
    emit("packages", True, "%d distributions" % len(versions), versions=versions)


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


def check_fla(state):
    """flash-linear-attention: installed, and its gated delta rule (what transformers' Qwen3.5 layers call)
    imports; with the Triton and GPU it will run on, for doctor to judge against the plan."""
    torch = need_torch(state)
    try:
        version = importlib.metadata.version("flash-linear-attention")
    except importlib.metadata.PackageNotFoundError:
        return False, "flash-linear-attention is not installed", {"installed": False}
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = None  # ROCm and XPU builds bring pytorch-triton-rocm / -xpu, and the module reports itself
    facts = {"installed": True, "version": version, "triton": triton, "capability": None}
    if torch.cuda.is_available() and not getattr(torch.version, "hip", None):
        facts["capability"] = "%d.%d" % torch.cuda.get_device_capability(0)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401 - the import is the check

    if facts["triton"] is None:
        import triton as triton_module

        facts["triton"] = triton_module.__version__
    return True, "flash-linear-attention %s imports (Triton %s)" % (version, facts["triton"]), facts


def check_llama_cpp(state):
    import llama_cpp  # loads the shared library: a wrong build fails here

    offload = bool(llama_cpp.llama_supports_gpu_offload())
    return True, "llama-cpp-python %s (GPU offload: %s)" % (llama_cpp.__version__, "yes" if offload else "no"), {
        "version": llama_cpp.__version__, "gpu_offload": offload,
    }


def torch_pin(requires):
    """The exact torch a distribution's Requires-Dist pins ("torch==2.13.0"), or None."""
    for text in requires or []:
        head = text.split(";")[0].replace(" ", "").replace("(", "").replace(")", "")
        if head.startswith("torch=="):
            return head[len("torch=="):].split(",")[0]
    return None


def check_vllm(state):
    torch = need_torch(state)
    try:
        dist = importlib.metadata.distribution("vllm")
    except importlib.metadata.PackageNotFoundError:
        return False, "vLLM is not installed", {}
    pin = torch_pin(dist.requires)
    have = torch.__version__.split("+")[0]
    facts = {"version": dist.version, "torch_pin": pin, "torch": torch.__version__}
    if pin is not None and pin != have:
        # Not imported: its compiled ops against another torch fail to load, or worse.
        return False, "vLLM %s is built for torch %s, but torch %s is installed" % (dist.version, pin, torch.__version__), dict(
            facts, matches=False)
    import vllm

    return True, "vLLM %s imports, built for torch %s (torch %s here)" % (
        getattr(vllm, "__version__", dist.version), pin or "any", torch.__version__), dict(facts, matches=True)


def check_multi_gpu(state):
    torch = need_torch(state)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 2:
        raise Skip("%d GPU(s): nothing to connect" % count)
    import torch.distributed as dist

    collective = "RCCL" if getattr(torch.version, "hip", None) else "NCCL"
    nccl = bool(dist.is_available() and dist.is_nccl_available())  # RCCL answers as NCCL on ROCm builds
    peers = {"%d-%d" % (i, j): bool(torch.cuda.can_device_access_peer(i, j))
             for i in range(count) for j in range(count) if i != j}
    # One copy between the first two GPUs: broken peer-to-peer (IOMMU, PCIe ACS) corrupts or hangs here.
    x = torch.arange(1 << 20, dtype=torch.float32, device="cuda:0")
    copied = bool(torch.equal(x.to("cuda:1").to("cuda:0"), x))
    no_peer = sorted(pair for pair, ok in peers.items() if not ok)
    message = "%d GPUs, %s %s, peer access %s, GPU 0 -> 1 copy %s" % (
        count, collective, "available" if nccl else "missing",
        "between all" if not no_peer else "missing for " + ", ".join(no_peer), "exact" if copied else "WRONG")
    return nccl and copied, message, {"count": count, "collective": collective, "nccl": nccl,
                                      "peer_access": peers, "copy_ok": copied}


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
    parser.add_argument("--only", type=lambda text: text.split(","), default=list(ORDER),
                        help="comma-separated checks to run, of: " + ",".join(ORDER))
    parser.add_argument("--with", dest="opt_in", action="append", default=[], choices=OPT_IN_CHECKS,
                        help="also check this opt-in part (installed with `unsloth install --with PART`)")
    parser.add_argument("--imports", nargs="*", default=[], metavar="MODULE",
                        help="also report whether these modules import, and every installed distribution")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.only) - set(ORDER))
    if unknown:
        parser.error("unknown check(s): " + ", ".join(unknown))
    if args.backend not in GPU_BACKENDS and "triton" in args.only:
        # Without a GPU, Triton can still prove it works through its interpreter.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    emit("python", True, sys.version.split()[0], executable=sys.executable)
    state = {}
    for name in checks_with(args.opt_in):
        if name in args.only:
            run(name, globals()["check_" + name], state)
    if args.imports:
        report_imports(args.imports)
    return 0


if __name__ == "__main__":
    sys.exit(main())
