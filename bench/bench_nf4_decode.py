"""A few rows times a 4-bit weight (a decode step of a batch): our fused kernel against bitsandbytes.

bitsandbytes' `matmul_4bit` (what its Linear4bit layers call) takes its gemv kernel for one row and
dequantizes the whole weight for more; `unsloth_kernels.nf4.nf4_matmul_small` reads the packed bytes
once. One JSON line per (shape, rows, implementation), do_bench medians, and the error against the
dense product. Llama-3.1-8B's projection shapes, nested absmax (bitsandbytes' default for QLoRA).

On the H200:  python3 bench/bench_nf4_decode.py  [--sweep]  (--sweep: the kernel's block configurations)
"""

from __future__ import annotations

import argparse
import json

import torch

SHAPES = {"q_proj": (4096, 4096), "k_proj": (1024, 4096), "gate_proj": (14336, 4096), "down_proj": (4096, 14336)}
SWEEP = [(bn, g, w) for bn in (16, 32, 64) for g in (1, 2, 4) for w in (2, 4, 8)]


def main(argv=None):
    import bitsandbytes as bnb
    import bitsandbytes.functional as F
    from triton.testing import do_bench
    from unsloth_kernels.nf4 import nf4_matmul_small, prepare_bnb_4bit

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--sweep", action="store_true")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        packed, state = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
        dense = F.dequantize_4bit(packed, state).to(torch.bfloat16)
        prepared = prepare_bnb_4bit(packed, state)
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ dense.float().T
            line = {"shape": name, "n": n, "k": k, "rows": m}
            bnb_ms = do_bench(lambda: bnb.matmul_4bit(x, packed.t(), quant_state=state))
            print(json.dumps({**line, "impl": "bitsandbytes", "ms": round(bnb_ms, 4)}), flush=True)
            configs = SWEEP if args.sweep else [None]
            best = None
            for config in configs:
                kw = {} if config is None else dict(block_n=config[0], groups=config[1], num_warps=config[2])
                try:
                    y = nf4_matmul_small(x, prepared, **kw)
                    ms = do_bench(lambda: nf4_matmul_small(x, prepared, **kw))
                except Exception as error:  # a configuration the compiler refuses
                    print(json.dumps({**line, "impl": "ours", "config": config, "error": str(error)[:200]}), flush=True)
                    continue
                err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                row = {**line, "impl": "ours", "config": config or "default", "ms": round(ms, 4),
                       "vs_bnb": round(ms / bnb_ms, 3), "rel_err": round(err, 5)}
                if best is None or ms < best["ms"]:
                    best = row
                if not args.sweep:
                    print(json.dumps(row), flush=True)
            if args.sweep and best:
                print(json.dumps({**best, "best": True}), flush=True)


if __name__ == "__main__":
    main()
