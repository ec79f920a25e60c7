"""Float64 PyTorch references for the Triton kernels, and the tolerance rule the tests share.

Every reference takes the *same* low-precision inputs the kernel got, upcasts them to float64 and
computes the exact math, so the only error left in a comparison is the kernel's own rounding.

Tolerance rule (`tolerance`): a kernel that computes in fp32 and stores in `dtype` makes
- a few roundings to `dtype` (inputs it re-rounds, like Llama's cast of the normalised row, and the
  final store): each at most the unit roundoff u(dtype) relative;
- fp32 accumulation error in its reductions: about sqrt(n) * u(fp32) for n terms summed in blocks
  (random-sign rounding errors add like a random walk; the worst-case bound n * u is never
  approached by blocked/tree sums).
So |actual - expected| <= tol * (|expected| + rms(expected)) with
    tol = ROUNDINGS * u(dtype) + sqrt(n_reduce) * u(fp32) * REDUCTION_SLACK.
The rms(expected) term is the absolute floor: gradients like RMSNorm's dx are differences of
terms of the row's scale, so an element that cancels to ~0 still carries an error of u times the
row's scale, not of its own size.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

import unsloth_kernels._utils as kernel_utils

# Small shapes run on the GPU when there is one, else on the CPU through TRITON_INTERPRET=1.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(DEVICE == "cpu" and not kernel_utils.INTERPRET,
                                   reason="Triton kernels need a GPU or TRITON_INTERPRET=1")

# Unit roundoff (half an ulp at 1.0) of each storage dtype: 2^-(significand bits).
UNIT_ROUNDOFF = {
    torch.bfloat16: 2.0**-8,   # 8 significand bits (7 stored + implicit)
    torch.float16: 2.0**-11,   # 11 significand bits
    torch.float32: 2.0**-24,   # 24 significand bits
    torch.float64: 2.0**-53,
}

# A kernel's result goes through at most ~4 roundings to the storage dtype (e.g. RMSNorm Llama
# mode: normalised row -> dtype, times weight -> dtype; the incoming gradient and saved inputs
# were already rounded once each).
ROUNDINGS = 4
# Blocked fp32 sums stay within a few sqrt(n) u; 4 covers the tails over many elements.
REDUCTION_SLACK = 4


def tolerance(dtype: torch.dtype, n_reduce: int = 1) -> float:
    """Relative tolerance for a result stored in `dtype` that summed `n_reduce` terms in fp32."""
    return ROUNDINGS * UNIT_ROUNDOFF[dtype] + REDUCTION_SLACK * math.sqrt(max(n_reduce, 1)) * UNIT_ROUNDOFF[torch.float32]


def assert_close_dtype(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, *,
                       n_reduce: int = 1, name: str = "tensor", factor: float = 1.0) -> None:
    """Assert `actual` (a kernel's output in `dtype`) matches the float64 `expected`.

    The bound is tol * (|expected| + rms(expected)), with tol from `tolerance` (see module doc);
    `factor` widens it for a result that chains several rounded steps (say why at the call site).
    """
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a = actual.detach().to(torch.float64).cpu()
    e = expected.detach().to(torch.float64).cpu()
    assert torch.isfinite(a).all(), f"{name}: non-finite values in the kernel output"
    tol = factor * tolerance(dtype, n_reduce)
    scale = e.pow(2).mean().sqrt().item() if e.numel() else 0.0
    bound = tol * (e.abs() + scale)
    err = (a - e).abs()
    bad = err > bound
    if bad.any():
        i = int(torch.argmax((err - bound).flatten()))
        raise AssertionError(
            f"{name} ({dtype}): {int(bad.sum())}/{e.numel()} elements off; worst at flat index {i}: "
            f"actual {a.flatten()[i].item():.6g}, expected {e.flatten()[i].item():.6g}, "
            f"error {err.flatten()[i].item():.3g} > bound {bound.flatten()[i].item():.3g} (tol {tol:.3g}, rms {scale:.3g})"
        )


def f64(*tensors: torch.Tensor):
    """Detached float64 copies that require grad, for computing reference gradients."""
    out = tuple(None if t is None else t.detach().to(torch.float64).requires_grad_(True) for t in tensors)
    return out if len(out) > 1 else out[0]


# --- references (float64 math; casting to the storage dtype is modelled only where the
# kernel's contract is to reproduce it, e.g. Llama's cast of the normalised row) --------------

def lm_head_inputs(n, hidden, vocab, dtype, *, seed=0, ignore=(), bias=False, device=None):
    """Hidden rows, an LM head (weight, optional bias) and labels (-100 at `ignore`) for the loss kernels."""
    g = torch.Generator().manual_seed(seed)
    device = device or DEVICE
    x = torch.randn(n, hidden, generator=g).to(device, dtype)
    # Logit scale ~ 3: a realistic spread, so the softmax is neither flat nor one-hot.
    w = (torch.randn(vocab, hidden, generator=g) * 3 / hidden**0.5).to(device, dtype)
    b = (torch.randn(vocab, generator=g) * 0.5).to(device, dtype) if bias else None
    labels = torch.randint(0, vocab, (n,), generator=g).to(device)
    for i in ignore:
        labels[i] = -100
    return x, w, b, labels


def rms_norm_ref(x, weight, eps=1e-6, offset=0.0, residual=None):
    """y = x / sqrt(mean(x^2) + eps) * (offset + weight); with residual, normalises x + residual."""
    if residual is not None:
        x = x + residual
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + weight)
    return (y, x) if residual is not None else y


def layer_norm_ref(x, weight, bias, eps=1e-5):
    return torch.nn.functional.layer_norm(x, x.shape[-1:], weight, bias, eps)


def rotate_half(t):
    t1, t2 = t.chunk(2, dim=-1)
    return torch.cat((-t2, t1), dim=-1)


def rope_ref(q, k, cos, sin, position_ids=None):
    """HF's apply_rotary_pos_emb on the first cos.shape[-1] dims; the rest pass through.

    cos/sin: (batch, seq, rot) or (seq, rot); with position_ids (batch, seq) they are a table
    (positions, rot) indexed by position.
    """
    if position_ids is not None:
        cos, sin = cos[position_ids], sin[position_ids]
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos[:, None], sin[:, None]
    rot = cos.shape[-1]

    def apply(t):
        tr, tp = t[..., :rot], t[..., rot:]
        return torch.cat((tr * cos + rotate_half(tr) * sin, tp), dim=-1)

    return apply(q), apply(k)


def swiglu_ref(gate, up):
    return torch.nn.functional.silu(gate) * up


def geglu_ref(gate, up, approximate="none"):
    return torch.nn.functional.gelu(gate, approximate=approximate) * up


# --- compiling for real GPUs without one -----------------------------------------------------
# The CPU interpreter runs kernels as numpy code, so it cannot catch what only the GPU compiler
# rejects (type mismatches in loop-carried values, unsupported ops, layouts). Triton's wheel
# carries the CUDA and ROCm backends (ptxas, lld), so CI compiles each kernel for both.

GPU_TARGETS = {"sm90": ("cuda", 90, 32), "gfx942": ("hip", "gfx942", 64)}
SCALAR_FLOATS = ("eps", "offset")


def compile_for_gpu(kernel, constexprs: dict, target: str, num_warps: int = 4, types: dict | None = None):
    """Compile a @triton.jit kernel for `target` (a GPU_TARGETS key) and return the compiled kernel.

    Pointer arguments are the kernel's UPPER-CASE parameters (bf16 here), scalars are i32 except
    SCALAR_FLOATS; `types` overrides any of these by name (e.g. {"packed_ptr": "*u8"}). Every
    pointer and integer gets the 16-divisibility a real launch with aligned tensors and 4096-wide
    rows is specialised with, so loads vectorise as they would on the GPU.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile as triton_compile

    names = kernel.arg_names
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.isupper():
            signature[name] = "*bf16"
        else:
            signature[name] = "fp32" if name in SCALAR_FLOATS else "i32"
    signature.update(types or {})
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
             if signature[name] not in ("constexpr", "fp32", "fp64")}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton_compile(source, target=GPUTarget(*GPU_TARGETS[target]), options={"num_warps": num_warps})


# Real model shapes take a GPU and a while; the GPU run turns them on.
real_shapes = pytest.mark.skipif(
    not (os.environ.get("UNSLOTH_TEST_REAL_SHAPES") == "1" and torch.cuda.is_available()),
    reason="real shapes: UNSLOTH_TEST_REAL_SHAPES=1 on a GPU",
)

# On a machine with a GPU the kernel launches already compile the kernels for real.
without_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run compiles the kernels for real")


def assert_compile_for_gpus(cases) -> None:
    """Compile `cases` for CUDA and ROCm GPUs (catching what the CPU interpreter cannot) and check
    that each has 16-byte vector loads on sm_90: the GPU needs them to reach memory bandwidth."""
    vectorised = compile_cases_for_gpu(cases)["sm90"]
    assert all(vectorised), [case[1] for case, v in zip(cases, vectorised) if not v]


def compile_cases_for_gpu(cases) -> dict[str, list[bool]]:
    """Compile each (module, kernel name, constexprs, num_warps) for every GPU_TARGETS entry, in a
    fresh interpreter without TRITON_INTERPRET (under it, @triton.jit gives interpreted functions
    that cannot be compiled). Returns, per target and case, whether the code has 16-byte vector
    global loads.
    """
    facts = gpu_compile_facts(cases)
    return {target: [fact["vector_loads"] for fact in per_case] for target, per_case in facts.items()}


def gpu_compile_facts(cases) -> dict[str, list[dict]]:
    """Compile each (module, kernel name, constexprs, num_warps[, types]) for every GPU_TARGETS
    entry (see compile_cases_for_gpu) and return, per target and case, what the code does with
    memory: {"vector_loads", "vector_stores"} (16-byte global accesses: PTX `ld/st.global.v4`,
    AMD `*_dwordx4`) and "shared" (bytes of shared memory, e.g. for a layout shuffle).
    """
    import json
    import os
    import subprocess
    import sys

    script = (
        "import importlib, json, sys\n"
        f"sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
        "from reference import compile_for_gpu\n"
        "from reference import GPU_TARGETS\n"
        "cases = json.loads(sys.argv[1])\n"
        "out = {target: [] for target in GPU_TARGETS}\n"
        "for target in GPU_TARGETS:\n"
        "    for module, name, constexprs, warps, *types in cases:\n"
        "        kernel = getattr(importlib.import_module(module), name)\n"
        "        compiled = compile_for_gpu(kernel, constexprs, target, warps, *types)\n"
        "        asm = compiled.asm.get('ptx', '') or compiled.asm.get('amdgcn', '')\n"
        "        out[target].append({'vector_loads': 'ld.global.v4' in asm or 'load_dwordx4' in asm,\n"
        "                            'vector_stores': 'st.global.v4' in asm or 'store_dwordx4' in asm,\n"
        "                            'shared': compiled.metadata.shared})\n"
        "print(json.dumps(out))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the current default, stated so Triton does not warn
    done = subprocess.run([sys.executable, "-c", script, json.dumps(cases)], env=env,
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise AssertionError(f"compiling for {list(GPU_TARGETS)} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def strided_layouts(rows, cols, dtype, seed):
    """The same (2, rows // 2, cols) values laid out three ways: contiguous, a transpose (last-dim
    stride > 1) and every other row of a taller tensor (rows apart in memory)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(2, rows // 2, cols, generator=g).to(dtype).to(DEVICE)
    transposed = base.transpose(-1, -2).contiguous().transpose(-1, -2)
    taller = torch.zeros(2, rows, cols, dtype=dtype, device=DEVICE)
    taller[:, ::2] = base
    return {"contiguous": base, "transposed": transposed, "row-strided": taller[:, ::2]}
