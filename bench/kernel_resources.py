"""Registers, spilled bytes and shared memory of our Triton kernels compiled for a GPU this machine
need not have: `triton.compile` for a CUDA target, then the cuobjdump bundled with Triton's NVIDIA
backend. No device time: a launch configuration that spills (STACK > 0) or needs most of an SM's
shared memory is a lead before a GPU is lent, and a sweep can skip it.

    python bench/kernel_resources.py                 # nf4_matmul's sweep configurations, sm_90
    python bench/kernel_resources.py --arch 100      # another target (Blackwell)
    python bench/kernel_resources.py --gated         # the LoRA MLP's activation kernel at GATED_SWEEP's tiles

One JSON line per configuration: the tuple as NF4_MATMUL_TUNING spells it (BLOCK_N, BLOCK_K, warps,
programs per SM, form, stages), the rows it is for, registers per thread, stack bytes (spills), dynamic shared
memory, and whether it is the configuration in use. Triton here may be newer than on the GPU
machine: register counts move a little between releases; spills that large do not go away.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile

import torch
import triton
from nf4_matmul import SWEEP, SWEEP_ROWS  # this folder: a script's own folder is on its path
from triton.backends.compiler import GPUTarget

from unsloth_kernels import lora as lora_module
from unsloth_kernels import nf4_matmul as nf4_matmul_module
from unsloth_kernels.nf4 import NF4_CODE

# _nf4_matmul_kernel's pointer and integer arguments, as a decode step calls it (bf16 x, nested
# absmax, K split into fp32 partial sums, so the LoRA update is the sum pass's)
NF4_SIGNATURE = {
    "x_ptr": "*bf16", "packed_ptr": "*u8", "absmax_ptr": "*u8", "code_ptr": "*fp32", "absmax2_ptr": "*fp32",
    "code2_ptr": "*fp32", "offset_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*fp32", "M": "i32",
    "N": "i32", "K": "i32", "stride_xm": "i32", "k_chunk": "i32", "xa_ptr": "*bf16", "lora_b_ptr": "*bf16",
    "lora_scale": "fp32",
}  # fmt: skip


# _gated_kernel's arguments in a bf16 step (LoRA parameters in bf16 too), and the tiles the sweeps try
GATED_SIGNATURE = {
    **dict.fromkeys(("E", "G", "DH", "XA", "BG", "BU", "DYB", "AD"), "*bf16"),
    **dict.fromkeys(("n_rows", "n_cols", "stride", "stride_xa", "sbg_r", "sbg_col", "sbu_r", "sbu_col", "stride_dyb",
                     "sad_r", "sad_col"), "i32"),
    "scale_g": "fp32", "scale_u": "fp32",
}  # fmt: skip
GATED_SWEEP = ((32, 128, 4), (32, 128, 8), (32, 64, 4), (32, 64, 8), (64, 64, 8), (16, 128, 8), (16, 64, 4))


def gated_rows(target: GPUTarget, arch: int):
    """One row per (rank, direction, tile) of the gated activation kernel with every LoRA term folded in."""
    kernel = getattr(lora_module._gated_kernel, "kernel", lora_module._gated_kernel)  # the JITFunction
    for rank in (16, 32, 64):
        for backward in (False, True):
            for block_m, block_n, warps in GATED_SWEEP:
                constants = dict(ACT=0, BACKWARD=backward, LORA=True, LORA_DH=backward, RANK_G=rank, RANK_U=rank,
                                 RANK_D=rank, BLOCK_R=rank, DOT_FP32=False, BLOCK_M=block_m, BLOCK_N=block_n)
                row = {"kernel": "gated", "rank": rank, "backward": backward, "config": [block_m, block_n, warps],
                       "in_use": (block_m, block_n, warps) == lora_module.GATED_TILE, "arch": arch}
                row.update(resources(kernel, GATED_SIGNATURE, constants, target, warps))
                yield row


def resources(kernel, signature: dict, constants: dict, target: GPUTarget, warps: int) -> dict:
    """Registers, stack (spill) bytes and dynamic shared memory of `kernel` compiled for `target`. The
    pointers and the integers but M are taken as multiples of 16, as a launch specializes them: without
    that the compiler cannot vectorize the loads, and the kernel compiled is not the one that runs."""
    names = list(signature)
    aligned = {(names.index(name),): [["tt.divisibility", 16]] for name in names
               if name != "M" and signature[name] != "fp32"}  # fmt: skip
    source = triton.compiler.ASTSource(fn=kernel, signature={**signature, **dict.fromkeys(constants, "constexpr")},
                                       constexprs=constants, attrs=aligned)  # fmt: skip
    compiled = triton.compile(source, target=target, options={"num_warps": warps})
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([cuobjdump, "-res-usage", cubin.name], capture_output=True, text=True, check=True).stdout
    fields = dict(item.split(":") for line in usage.splitlines() if "REG:" in line for item in line.split())
    return {"registers": int(fields["REG"]), "stack_bytes": int(fields["STACK"]),
            "shared_bytes": int(compiled.metadata.shared)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10 (90: H100 / H200)")
    parser.add_argument("--gated", action="store_true", help="the LoRA MLP's activation kernel instead of nf4_matmul")
    args = parser.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    if args.gated:
        for row in gated_rows(target, args.arch):
            print(json.dumps(row), flush=True)
        return
    for kind, configs in SWEEP.items():
        rows = SWEEP_ROWS[kind]
        for config in configs:
            block_n, block_k, warps, _, form, *stages = config
            constants = dict(BLOCKSIZE=64, BLOCKSIZE2=256, NESTED=True, HAS_BIAS=False, HAS_LORA=False, RANK=0,
                             PARTIAL=True, ROUND_BF16=False, BLOCK_N=block_n)  # fmt: skip
            if form != "reduce":
                kernel = nf4_matmul_module._nf4_dot_kernel
                constants.update(FP32=False, BLOCK_M=16, STEP_BLOCKS=max(block_k // 64, 1), PRECISION=None,
                                 LEVELS_ASM=nf4_matmul_module.levels_asm(NF4_CODE, torch.bfloat16),
                                 W_AS_B=form == "dot_w_b", STAGES=stages[0] if stages else None,
                                 X_HALVES=nf4_matmul_module.X_HALVES)  # fmt: skip
            else:
                kernel = nf4_matmul_module._nf4_matmul_kernel
                constants.update(BLOCK_M=rows, BLOCK_K=block_k, GROUP=min(64, block_k))
            row = {"kernel": "nf4_matmul", "kind": kind, "rows": rows, "config": list(config),
                   "in_use": tuple(config) == tuple(nf4_matmul_module.NF4_MATMUL_TUNING[kind]), "arch": args.arch}
            row.update(resources(kernel, NF4_SIGNATURE, constants, target, warps))
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
