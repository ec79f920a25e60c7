"""The chunked gated delta rule, forward + backward: our torch rule (unsloth_kernels.delta_rule) against
transformers' torch reference (what runs without flash-linear-attention), in one process, on the
same inputs, turn about (so that a shared machine's load falls on both alike).

    PYTHONPATH=src:kernels python3 bench/delta_rule.py                 # Qwen3.5-shaped: 16 heads of 128, seq 2048
    PYTHONPATH=src:kernels python3 bench/delta_rule.py --device cuda --dtype bfloat16

Printed: the median seconds of each over --reps timed runs (after one warm-up each), their ratio, and
the largest difference between the two outputs (a check that both computed the same thing).
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time

import torch

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=1)
p.add_argument("--seq", type=int, default=2048)
p.add_argument("--heads", type=int, default=16, help="value heads (Qwen3.5: 16 key heads, 16 or 32 value heads)")
p.add_argument("--key-heads", type=int, default=16)
p.add_argument("--dim", type=int, default=128)
p.add_argument("--dtype", default="float32")
p.add_argument("--device", default="cpu")
p.add_argument("--reps", type=int, default=3)
p.add_argument("--threads", type=int, default=0, help="torch threads on the CPU (0: torch's default)")
args = p.parse_args()
if args.threads:
    torch.set_num_threads(args.threads)

from transformers.models.qwen3_5 import modeling_qwen3_5  # noqa: E402

from unsloth_kernels.delta_rule import chunk_gated_delta_rule  # noqa: E402

reference = inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)
dtype, device = getattr(torch, args.dtype), torch.device(args.device)
gen = torch.Generator().manual_seed(0)
b, t, hk, hv, d = args.batch, args.seq, args.key_heads, args.heads, args.dim
inputs = [torch.randn(b, t, hk, d, generator=gen), torch.randn(b, t, hk, d, generator=gen),
          torch.randn(b, t, hv, d, generator=gen), -torch.rand(b, t, hv, generator=gen) * 0.5,
          torch.rand(b, t, hv, generator=gen)]
inputs = [x.to(device, dtype).requires_grad_() for x in inputs]
grad_out = torch.randn(b, t, hv, d, generator=gen).to(device, dtype)


def step(rule):
    for x in inputs:
        x.grad = None
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out, _ = rule(*inputs, use_qk_l2norm_in_kernel=True)
    out.backward(grad_out)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, out.detach()


rules = {"transformers": reference, "ours": chunk_gated_delta_rule}
outs = {name: step(rule)[1] for name, rule in rules.items()}  # warm-up
times = {name: [] for name in rules}
for _ in range(args.reps):
    for name, rule in rules.items():
        times[name].append(step(rule)[0])
theirs, ours = (statistics.median(times[name]) for name in rules)
print(f"{device.type} {args.dtype} batch {b}, seq {t}, {hk} key / {hv} value heads of {d}, "
      f"threads {torch.get_num_threads()}, forward + backward, median of {args.reps}:")
print(f"  transformers' torch reference {theirs:.3f} s, ours {ours:.3f} s: {theirs / ours:.2f}x; "
      f"largest output difference {(outs['ours'].float() - outs['transformers'].float()).abs().max():.2e}")
