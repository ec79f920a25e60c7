"""Few-row NF4 matmul (the 4-bit decode step's base projections): ours vs bitsandbytes, one process.

At Llama-3.1-8B projection shapes (q/o, k/v, gate/up, down), M = 1, 8, 16 rows, bf16, NF4 with
double-quantized absmax (what QLoRA loads), times y = x @ W^T three ways:
- ours: unsloth_kernels.nf4_matmul (reads the packed weight once, dequantizes in registers);
- bnb: bitsandbytes.matmul_4bit, what a decode step runs today (a gemv for 1 row; for more rows it
  dequantizes the whole weight to bf16, then a matmul);
- dequant+mm: bitsandbytes.functional.dequantize_4bit then torch's matmul, spelled out.
ms is the median of triton.testing.do_bench (host launch time included); graph ms the same call
replayed from a CUDA graph, as the compiled decode step runs it (the GPU time alone); ratios are
bnb / ours and dequant+mm / ours (> 1: ours is faster); GB/s is ours (graph ms where there is one)
over the packed weight's bytes (packed + absmax), the bytes it must read.

    python bench/nf4_matmul.py            # on a GPU
    python bench/nf4_matmul.py --sweep --tuning-out tuning.json   # first tries launch configurations
    python bench/nf4_matmul.py --compiled   # adds ours inside torch.compile (1 and 8 rows), as decoding runs it
    python bench/nf4_matmul.py --lora 16    # a LoRA update in our pass, against adding it after (max diff: of those)
    python bench/nf4_matmul.py --flat-scales   # adds ours with one fp32 scale per block (no nested absmax)
    python bench/nf4_matmul.py --ab            # adds ours unpipelined, and unpipelined reading x strided
    TRITON_INTERPRET=1 python bench/nf4_matmul.py --tiny   # a smoke test on the CPU, tiny shapes

--sweep times every configuration of SWEEP (nf4_matmul.NF4_MATMUL_TUNING's tuple: BLOCK_N, BLOCK_K,
warps, programs per SM, form, pipeline stages) for a few rows ("few", M = 8) and one ("one", M = 1),
from a CUDA graph, summed over a decode step's projections (WEIGHTS: how many of each shape a layer
has), keeps the fastest of each for the table, and with --tuning-out writes them as JSON for
bench_generation.py --nf4-tuning.

Prints one line per row to stderr, then a markdown table and one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import bitsandbytes as bnb
import bitsandbytes.functional as bnb_functional
import torch
from bench_kernels import graph_ms  # this folder: a script's own folder is on its path

from unsloth_kernels import nf4_matmul as nf4_matmul_module
from unsloth_kernels.nf4 import prepare_4bit, prepare_bnb_4bit
from unsloth_kernels.nf4_matmul import nf4_matmul

# (name, N = out features, K = in features) of Llama-3.1-8B's projections
SHAPES = [("q_proj / o_proj", 4096, 4096), ("k_proj / v_proj", 1024, 4096), ("gate_proj / up_proj", 14336, 4096),
          ("down_proj", 4096, 14336)]  # fmt: skip
TINY_SHAPES = [("tiny", 72, 320), ("tiny split", 200, 576)]
ROWS = (1, 8, 16)
WEIGHTS = {"q_proj / o_proj": 2, "k_proj / v_proj": 2, "gate_proj / up_proj": 2, "down_proj": 1, "tiny": 1,
           "tiny split": 1}  # fmt: skip
# (BLOCK_N, BLOCK_K, warps, programs per SM, form[, stages]) tried by --sweep: the 2026-12-06 sweep's
# best unpipelined, the K loop pipelined around it (tiles, stages, fewer and more K splits), and the
# reductions' best (the 2026-12-03 sweep's; for several rows, the kernel's own fallback). "one" tries its
# reduction and the few rows' best dot configurations (a dot costs the same for 1 row as for 16).
_DOT = ([(128, 64, 4, 4, "dot_w_b"), (128, 64, 4, 4, "dot_w_a", 3), (128, 64, 4, 2, "dot_w_b", 3)]
        + [(128, 64, 4, 4, "dot_w_b", stages) for stages in (2, 3, 4)]
        + [(64, 64, 4, 4, "dot_w_b", stages) for stages in (3, 4)]
        + [(128, 128, 4, 4, "dot_w_b", stages) for stages in (2, 3)]
        + [(128, 64, 4, 8, "dot_w_b", 3), (128, 64, 4, 2, "dot_w_b", 4), (256, 64, 8, 4, "dot_w_b", 3)])  # fmt: skip
SWEEP = {"few": _DOT + [nf4_matmul_module.REDUCE_FALLBACK], "one": [(16, 512, 4, 2, "reduce")]}
ONE_FROM_FEW = 4  # how many of the few rows' best configurations "one" tries too
SWEEP_ROWS = {"one": 1, "few": 8}


def timed(fn, device) -> float:
    """Median ms of fn: do_bench on a GPU; a few wall-clock runs elsewhere (the interpreter smoke test)."""
    if device == "cuda":
        import triton

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - start) * 1e3)
    return statistics.median(runs)


def quantized(shapes, device, dtype):
    """(name, n, k, packed, state, prepared) per shape: NF4 with double-quantized absmax, as QLoRA loads."""
    out = []
    for name, n, k in shapes:
        weight = torch.randn(n, k, device=device, dtype=dtype) * 0.02
        packed, state = bnb_functional.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4")
        state.dtype = dtype
        out.append((name, n, k, packed, state, prepare_bnb_4bit(packed, state)))
    return out


def flat_scales(packed, state):
    """The same weight prepared with one fp32 absmax per block (its nested absmax dequantized)."""
    absmax = bnb_functional.dequantize_blockwise(state.absmax, state.state2) + state.offset
    return prepare_4bit(packed, absmax.float(), state.shape, blocksize=state.blocksize, code=state.code, nf4=True)


def sweep(weights, device, dtype, tiny=False) -> dict[str, list]:
    """The fastest configuration of SWEEP per kind, by a decode step's weighted graph time (with --tiny,
    the first and last only: the interpreter's smoke test of this code)."""
    best, ranked = {}, []
    for kind, configs in SWEEP.items():  # "few" first: "one" also tries its best dot configurations
        configs = configs[:1] + configs[-1:] if tiny else configs
        if kind == "one":
            configs = configs + [config for _, config in ranked if config[-1] != "reduce"][:ONE_FROM_FEW]
        xs = [torch.randn(SWEEP_ROWS[kind], k, device=device, dtype=dtype) for _, _, k, *_ in weights]
        scores = []
        for config in configs:
            nf4_matmul_module.NF4_MATMUL_TUNING[kind] = config
            total = 0.0
            for x, (name, *_, prepared) in zip(xs, weights):
                fn = lambda: nf4_matmul(x, prepared)  # noqa: E731, B023 - called at once
                ms = graph_ms(fn) if device == "cuda" else timed(fn, device)
                total = float("inf") if ms is None else total + WEIGHTS[name] * ms
            scores.append((total, config))
            print(json.dumps({"sweep": kind, "config": config, "weighted ms": round(total, 4)}), file=sys.stderr)
        ranked = sorted(scores)
        best[kind] = list(ranked[0][1])
        nf4_matmul_module.NF4_MATMUL_TUNING[kind] = tuple(best[kind])
        print(json.dumps({"sweep best": kind, "config": best[kind], "weighted ms": round(min(scores)[0], 4)}),
              file=sys.stderr)  # fmt: skip
    return best


def compiled(fn, expected):
    """fn through torch.compile as the decode step compiles it (fullgraph, static shapes), or None with
    the error printed when it does not compile or disagrees with the eager call."""
    import traceback

    torch._dynamo.reset()
    try:
        traced = torch.compile(fn, fullgraph=True, dynamic=False)
        got = traced()
    except Exception:  # noqa: BLE001 - a diagnostic column: say why, go on
        traceback.print_exc()
        return None
    if not torch.equal(got, expected):
        diff = (got.float() - expected.float()).abs().max().item()
        print(json.dumps({"compiled": "differs from eager", "max diff": diff}), file=sys.stderr)
    return traced


def variant(fn, x_halves: bool, stages: bool):
    """`fn` with nf4_matmul's dot kernel reading x strided (X_HALVES off) and/or its K loop unpipelined
    (the configurations without stages): a CUDA graph captures whichever kernels ran then."""
    def run():
        tuning, halves = dict(nf4_matmul_module.NF4_MATMUL_TUNING), nf4_matmul_module.X_HALVES
        nf4_matmul_module.X_HALVES = x_halves
        if not stages:
            nf4_matmul_module.NF4_MATMUL_TUNING.update({kind: config[:5] for kind, config in tuning.items()})
        try:
            return fn()
        finally:
            nf4_matmul_module.X_HALVES = halves
            nf4_matmul_module.NF4_MATMUL_TUNING.update(tuning)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (for TRITON_INTERPRET=1 on the CPU)")
    parser.add_argument("--sweep", action="store_true", help="first pick the launch configurations (see above)")
    parser.add_argument("--tuning-out", help="write the swept configurations here (JSON)")
    parser.add_argument("--lora", type=int, metavar="RANK",
                        help="add a LoRA update of this rank: ours in nf4_matmul's pass (lora=) against ours then "
                             "peft's B matmul and addition (x A^T is computed once, outside both)")
    parser.add_argument("--flat-scales", action="store_true",
                        help="also time ours on the same weight with its double-quantized absmax expanded to one fp32 "
                             "scale per block (no dependent loads per block; 4 bytes per 64 weights instead of ~1)")
    parser.add_argument("--ab", action="store_true",
                        help="also time ours unpipelined (no stages), and unpipelined reading x strided (as before "
                             "X_HALVES), same process")
    parser.add_argument("--compiled", action="store_true",
                        help="also time ours inside torch.compile (fullgraph, as the decode step runs it)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16
    weights = quantized(TINY_SHAPES if args.tiny else SHAPES, device, dtype)
    if args.sweep:
        best = sweep(weights, device, dtype, tiny=args.tiny)
        if args.tuning_out:
            with open(args.tuning_out, "w") as f:
                json.dump(best, f)
    results = []
    for name, n, k, packed, state, prepared in weights:
        weight_bytes = packed.numel() + state.absmax.numel() * state.absmax.element_size()
        for m in ROWS:
            x = torch.randn(m, k, device=device, dtype=dtype)
            ours = lambda: nf4_matmul(x, prepared)  # noqa: E731
            if args.lora:  # fp32 adapters, as QLoRA keeps them; the update added in our pass or after it
                xa = x.float() @ torch.randn(args.lora, k, device=device).T / k
                lora_b = torch.randn(n, args.lora, device=device) / args.lora
                ours = lambda: nf4_matmul(x, prepared, lora=(xa, lora_b, 2.0))  # noqa: E731
                unfused = lambda: nf4_matmul(x, prepared) + ((xa @ lora_b.T) * 2.0).to(dtype)  # noqa: E731
            theirs = lambda: bnb.matmul_4bit(x, packed.t(), quant_state=state)  # noqa: E731
            spelled = lambda: x @ bnb_functional.dequantize_4bit(packed, state).t()  # noqa: E731
            diff = (ours().float() - (unfused if args.lora else theirs)().float()).abs().max().item()
            fns = (("ours", ours), ("bnb", theirs), ("dequant+mm", spelled))
            if args.lora:
                fns += (("ours, peft's update after", unfused),)
            flat = None
            if args.flat_scales:
                flat = flat_scales(packed, state)
                fns += (("ours, flat scales", lambda: nf4_matmul(x, flat)),)  # noqa: B023 - called at once
            if args.ab:
                fns += (("ours, unpipelined", variant(ours, x_halves=True, stages=False)),
                        ("ours, unpipelined, x strided", variant(ours, x_halves=False, stages=False)))
            if args.compiled and m in SWEEP_ROWS.values():
                fns += (("compiled", compiled(ours, ours())),)
            ms = {label: timed(fn, device) for label, fn in fns if fn is not None}
            graph = {label: graph_ms(fn) if device == "cuda" and fn is not None else None for label, fn in fns}
            row = {"shape": name, "N": n, "K": k, "M": m, **{f"{key} ms": round(v, 4) for key, v in ms.items()},
                   **{f"{key} graph ms": v and round(v, 4) for key, v in graph.items()},
                   "bnb / ours": round(ms["bnb"] / ms["ours"], 3),
                   "dequant+mm / ours": round(ms["dequant+mm"] / ms["ours"], 3),
                   "graph bnb / ours": graph["ours"] and graph["bnb"] and round(graph["bnb"] / graph["ours"], 3),
                   "ours GB/s": round(weight_bytes / (graph["ours"] or ms["ours"]) / 1e6, 1),
                   "max |ours - bnb|": diff,
                   "max |flat - ours|": flat and (nf4_matmul(x, flat).float() - ours().float()).abs().max().item(),
                   }  # fmt: skip
            print(json.dumps(row), file=sys.stderr)
            results.append(row)
    keys = list(dict.fromkeys(key for row in results for key in row))
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in results:
        print("| " + " | ".join(str(row.get(key, "")) for key in keys) + " |")
    print(json.dumps({"device": torch.cuda.get_device_name() if device == "cuda" else device,
                      "tuning": nf4_matmul_module.NF4_MATMUL_TUNING, "rows": results}))


if __name__ == "__main__":
    main()
