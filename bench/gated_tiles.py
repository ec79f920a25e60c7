"""Time the LoRA MLP (forward + backward) with each tile of the gated activation kernel, at the ranks
and shapes the benches train: Orpheus-3B's MLP (2048 tokens, 3072 -> 8192, r=64, the TTS bench) and
Llama-3.1-8B's (16384 tokens, 4096 -> 14336, r=16, the trainer bench). bf16, dense frozen bases.

    python bench/gated_tiles.py [--only tts,llama8b]

One JSON line per (shape, tile): do_bench median ms, and whether the tile is the one in use
(unsloth_kernels.lora.GATED_TILE, which each row sets).
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from kernel_resources import GATED_SWEEP
from unsloth_kernels import lora as lora_module
from unsloth_kernels.lora import LoraWeights, lora_mlp

SHAPES = {"tts": (2048, 3072, 8192, 64), "llama8b": (16384, 4096, 14336, 16)}  # tokens, hidden, intermediate, rank


def projection(out_features, in_features, rank, generator):
    def rand(*shape, scale):
        return (torch.randn(*shape, generator=generator, device="cuda") * scale).to(torch.bfloat16)

    A = rand(rank, in_features, scale=in_features**-0.5).requires_grad_()
    B = rand(out_features, rank, scale=rank**-0.5).requires_grad_()
    return LoraWeights(rand(out_features, in_features, scale=in_features**-0.5), A, B, 1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(SHAPES))
    args = parser.parse_args()
    for name in args.only.split(","):
        tokens, hidden, inter, rank = SHAPES[name]
        g = torch.Generator(device="cuda").manual_seed(0)
        gate, up, down = projection(inter, hidden, rank, g), projection(inter, hidden, rank, g), projection(hidden, inter, rank, g)
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        dy = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
        in_use = lora_module.GATED_TILE

        def step():
            lora_mlp(x, gate, up, down).backward(dy)

        for tile in GATED_SWEEP:
            lora_module.GATED_TILE = tile
            ms = triton.testing.do_bench(step, warmup=10, rep=50, return_mode="median")
            print(json.dumps({"shape": name, "tokens": tokens, "rank": rank, "tile": list(tile),
                              "in_use": tile == in_use, "ms": round(ms, 4)}), flush=True)
        lora_module.GATED_TILE = in_use


if __name__ == "__main__":
    main()
