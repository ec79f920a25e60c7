"""MoE benchmark: (a) the experts alone, (b) a LoRA / QLoRA training step, at gpt-oss-20b and
Qwen3-30B-A3B shapes. One JSON line per measurement; ours and the alternative in the same process.

(a) `--part kernel`: the routed experts of one layer, forward + backward, LoRA r=16 on gate_up and
    down, 2 x 2048 tokens, random routing with the model's top-k. Ours (`impl="triton"`) against
    the same math on `torch._grouped_mm` with the LoRA terms as separate grouped matmuls and
    autograd (`impl="torch"`): median of `triton.testing.do_bench`, peak extra memory. Target: ours
    at least 1.5x faster.
(c) `--part tune`: sweeps the kernel's launch configurations (unsloth_kernels.moe.MOE_TUNING) on
    the experts step at both shapes, checking each against torch, and prints the best with its
    ratios against `torch._grouped_mm` (about 3-4 minutes; `--budget-s` caps the sweep).
(b) `--part step`: a training step of the model built from its config with random weights and
    FEWER LAYERS (`--layers`, default 2: the full models do not fit a call's time), LoRA r=16 on
    attention and experts, batch 2 x 2048; `--impl ours|unsloth|hf` (hf = transformers + peft),
    `--four-bit` for QLoRA (bitsandbytes NF4 of the linear layers; ours also quantizes the packed
    expert stacks to NF4 as they load, as load_pretrained does). Median step, peak memory (of the
    steps, and of loading), expert stacks' GiB.

    python bench/bench_moe.py --part kernel                       # about 1 minute on an H200
    python bench/bench_moe.py --part step --impl ours [--four-bit]
    python bench/bench_moe.py --part tune [--budget-s 200]        # sweep MOE_TUNING, print the best
    python bench/bench_moe.py --tiny --part kernel                # CPU check (TRITON_INTERPRET=1)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

SHAPES = {
    # hidden, intermediate, experts, top-k, activation, layout, transposed, biases
    "gpt-oss-20b": dict(hidden=2880, inter=2880, experts=32, k=4, activation="gpt_oss", layout="interleaved",
                        transposed=True, bias=True),  # fmt: skip
    "qwen3-30b-a3b": dict(hidden=2048, inter=768, experts=128, k=8, activation="swiglu", layout="concatenated",
                          transposed=False, bias=False),  # fmt: skip
}
TINY = {"tiny": dict(hidden=32, inter=16, experts=6, k=2, activation="swiglu", layout="concatenated",
                     transposed=False, bias=False)}  # fmt: skip


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def experts_inputs(shape: dict, tokens: int, rank: int, dtype, seed=0):
    """Random routed inputs and expert stacks with LoRA (B non-zero), peft's storage layout."""
    from unsloth_kernels.moe import ExpertWeights

    g = torch.Generator(device=device()).manual_seed(seed)
    dev = device()
    h, i, e, k = shape["hidden"], shape["inter"], shape["experts"], shape["k"]
    x = torch.randn(tokens, h, device=dev, dtype=dtype, generator=g).requires_grad_()
    index = torch.rand(tokens, e, device=dev, generator=g).topk(k, dim=-1).indices
    weights = torch.softmax(torch.randn(tokens, k, device=dev, generator=g), -1).to(dtype)
    stacks, leaves = [], []
    for out, inp in ((2 * i, h), (h, i)):
        w = torch.randn((e, inp, out) if shape["transposed"] else (e, out, inp), device=dev, dtype=dtype,
                        generator=g) / inp**0.5  # fmt: skip
        A = (torch.randn(e * rank, inp, device=dev, dtype=dtype, generator=g) / inp**0.5).requires_grad_()
        B = (torch.randn(out, rank * e, device=dev, dtype=dtype, generator=g) * 0.01).requires_grad_()
        bias = torch.randn(e, out, device=dev, dtype=dtype, generator=g) * 0.01 if shape["bias"] else None
        stacks.append(ExpertWeights(w, A.view(e, rank, inp), B.view(out, rank, e).permute(2, 0, 1), 2.0, bias,
                                    transposed=shape["transposed"]))  # fmt: skip
        leaves += [A, B]
    return x, index, weights, stacks, leaves


def bench_kernel(args) -> None:
    from unsloth_kernels.moe import moe_experts

    dtype = torch.bfloat16 if device() == "cuda" else torch.float32
    shapes = TINY if args.tiny else SHAPES
    tokens = 8 if args.tiny else args.batch * args.seq
    for name, shape in shapes.items():
        x, index, weights, (gate_up, down), leaves = experts_inputs(shape, tokens, args.rank, dtype)
        dy = torch.randn(tokens, shape["hidden"], device=device(), dtype=dtype)
        results = {}
        for impl in ("triton", "torch") if not args.only else (args.only,):

            def step():
                for t in (x, *leaves):
                    t.grad = None
                out = moe_experts(x, index, weights, gate_up, down, activation=shape["activation"],
                                  layout=shape["layout"], impl=impl)  # fmt: skip
                out.backward(dy)
                return out

            out = step()  # compile / warm up, and the result to compare
            results[impl] = (out.detach().float(), [t.grad.float() for t in (x, *leaves)])
            ms, peak = timed(step, args.tiny)
            flops = 2 * 3 * tokens * shape["k"] * 3 * shape["hidden"] * shape["inter"]  # fwd + 2 bwd GEMMs, 3 weights
            print(json.dumps({"part": "kernel", "shape": name, "impl": "ours" if impl == "triton" else "torch_grouped_mm",
                              "tokens": tokens, "top_k": shape["k"], "rank": args.rank, "dtype": str(dtype),
                              "ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1), "peak_extra_gib": round(peak, 3)}),
                  flush=True)  # fmt: skip
        if len(results) == 2:  # the two agree: same math
            (o1, g1), (o2, g2) = results["triton"], results["torch"]
            rel = [((a - b).norm() / b.norm().clamp_min(1e-12)).item() for a, b in zip([o1, *g1], [o2, *g2])]
            print(json.dumps({"part": "kernel", "shape": name, "check": "ours vs torch", "max_rel_diff": max(rel)}))


def timed(step, tiny: bool) -> tuple[float, float]:
    """(median ms, peak extra GiB) of step()."""
    if device() != "cuda":
        times = []
        for _ in range(1 if tiny else 3):
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times), 0.0
    import triton.testing

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median"), peak


# --- (c) the launch configurations, swept on the GPU -----------------------------------------------

# Candidates per kernel kind of unsloth_kernels.moe.MOE_TUNING (the first is the current default).
# Each is timed on the whole experts step (fwd + bwd) at every shape, the other kinds held at their
# best so far (coordinate descent, in this order: the big GEMMs first).
TUNE_CANDIDATES = {
    "gemm": [(64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (128, 128, 64, 4, 3), (128, 128, 64, 8, 4),
             (128, 256, 64, 8, 3), (64, 256, 64, 8, 3), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4),
             (128, 128, 32, 4, 4), (128, 256, 32, 8, 4), (256, 128, 64, 8, 3), (64, 64, 64, 4, 4)],
    "skinny": [(64, 128, 64, 4, 3), (128, 128, 64, 4, 3), (128, 128, 128, 8, 3), (256, 128, 64, 8, 3),
               (64, 128, 128, 4, 4), (32, 128, 128, 4, 3)],
    "outer": [(64, 64, 64, 4, 3), (64, 128, 64, 4, 3), (128, 64, 64, 4, 3), (64, 64, 128, 4, 3),
              (128, 128, 64, 8, 3), (64, 128, 128, 8, 3), (32, 128, 128, 4, 4)],
    "act": [(32, 128, 4), (64, 128, 4), (16, 256, 4), (64, 256, 8)],
}


def bench_tune(args) -> None:
    """Sweep MOE_TUNING on the experts step at every shape; one JSON line per (kind, config), then
    the best configuration (lowest mean of ours / torch._grouped_mm over the shapes) and its ratios."""
    import triton.testing

    from unsloth_kernels import moe

    dtype = torch.bfloat16 if device() == "cuda" else torch.float32
    shapes = TINY if args.tiny else SHAPES
    tokens = 8 if args.tiny else args.batch * args.seq
    steps, reference, torch_ms = {}, {}, {}
    for name, shape in shapes.items():
        x, index, weights, (gate_up, down), leaves = experts_inputs(shape, tokens, args.rank, dtype)
        dy = torch.randn(tokens, shape["hidden"], device=device(), dtype=dtype)

        def step(impl="triton", x=x, index=index, weights=weights, gate_up=gate_up, down=down, leaves=leaves, dy=dy,
                 shape=shape):  # fmt: skip
            for t in (x, *leaves):
                t.grad = None
            out = moe.moe_experts(x, index, weights, gate_up, down, activation=shape["activation"],
                                  layout=shape["layout"], impl=impl)  # fmt: skip
            out.backward(dy)
            return [out.detach().float(), *(t.grad.float() for t in (x, *leaves))]

        steps[name] = step
        reference[name] = step("torch")
        torch_ms[name] = timed(lambda: step("torch"), args.tiny)[0]

    def measure(tuning) -> dict | None:
        moe.MOE_TUNING.update(tuning)
        row = {}
        for name, step in steps.items():
            got = step()  # compiles, and checks the math: a bad config must not win by being wrong
            err = max(((a - b).norm() / b.norm().clamp_min(1e-12)).item() for a, b in zip(got, reference[name]))
            if not err < 0.02:
                return {"error": f"{name}: relative difference {err:.3g} from torch"}
            ms = timed(step, args.tiny)[0] if args.tiny else triton.testing.do_bench(step, warmup=5, rep=40,
                                                                                   return_mode="median")  # fmt: skip
            row[name] = round(ms, 3)
        row["mean_ratio"] = round(statistics.mean(torch_ms[n] / row[n] for n in steps), 3)
        return row

    deadline = time.monotonic() + args.budget_s
    best = dict(moe.MOE_TUNING)
    best_row = measure(best)
    print(json.dumps({"part": "tune", "kind": "default", "config": best, **best_row,
                      "torch_grouped_mm_ms": {n: round(v, 3) for n, v in torch_ms.items()}}), flush=True)  # fmt: skip
    for kind, candidates in TUNE_CANDIDATES.items():
        for config in candidates[1:] if not args.tiny else candidates[1:2]:
            if time.monotonic() > deadline:
                print(json.dumps({"part": "tune", "stopped": "budget", "budget_s": args.budget_s}), flush=True)
                break
            try:
                row = measure({**best, kind: config})
            except Exception as e:  # noqa: BLE001 - a config the GPU cannot run (shared memory): the next one
                row = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
            print(json.dumps({"part": "tune", "kind": kind, "config": config, **row}), flush=True)
            if "error" not in row and row["mean_ratio"] > best_row["mean_ratio"]:
                best, best_row = {**best, kind: config}, row
    moe.MOE_TUNING.update(best)
    print(json.dumps({"part": "tune", "best": best, **best_row}), flush=True)


# --- (b) a training step --------------------------------------------------------------------------


def model_config(name: str, layers: int, tiny: bool):
    import transformers as t

    if tiny:
        return t.Qwen3MoeConfig(vocab_size=300, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                num_experts=6, num_experts_per_tok=2)  # fmt: skip
    if name == "gpt-oss-20b":  # openai/gpt-oss-20b's config.json, fewer layers
        return t.GptOssConfig(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=layers,
                              num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                              num_experts_per_tok=4, sliding_window=128,
                              layer_types=["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (layers % 2))  # fmt: skip
    return t.Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                            num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                            num_experts=128, num_experts_per_tok=8, norm_topk_prob=True)  # fmt: skip


def build_model_dir(name, layers, tiny, path):
    """Save the random model (bf16) to `path`, once, so every impl loads the same checkpoint."""
    import os

    from transformers import AutoModelForCausalLM

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(0)
    config = model_config(name, layers, tiny)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if not tiny else torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 3 or "router" in n or ".gate." in n:
                p.normal_(0.0, 0.02)
    model.save_pretrained(path)
    return path


TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def load(impl, path, args):
    dtype = torch.float32 if args.tiny else torch.bfloat16
    if impl == "ours":
        # load_pretrained's steps without its tokenizer (the random checkpoint has none)
        from transformers import AutoModelForCausalLM

        from unsloth.models.loader import _experts_in_4bit_while_loading, _quantize_experts, add_lora
        from unsloth.models.patches import patch_model

        # as load_pretrained(load_in_4bit=True): the expert stacks in NF4 too, quantized as they load
        with _experts_in_4bit_while_loading(args.four_bit):
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device(),
                                                         quantization_config=quantization(args, dtype))  # fmt: skip
        patch_model(model)
        model.requires_grad_(False)
        if args.four_bit:
            _quantize_experts(model)
        return add_lora(model, r=args.rank, lora_alpha=args.rank, target_modules=TARGETS)
    if impl == "unsloth":
        from unsloth import FastLanguageModel  # the public package (PYTHONPATH without our source)

        model, _ = FastLanguageModel.from_pretrained(path, dtype=dtype, load_in_4bit=args.four_bit,
                                                     max_seq_length=args.seq)  # fmt: skip
        return FastLanguageModel.get_peft_model(model, r=args.rank, lora_alpha=args.rank, target_modules=TARGETS,
                                                use_gradient_checkpointing="unsloth")  # fmt: skip
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device(),
                                                 quantization_config=quantization(args, dtype))  # fmt: skip
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    params = ["experts.gate_up_proj", "experts.down_proj"]
    return get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=args.rank, target_modules=TARGETS,
                                            target_parameters=params, task_type="CAUSAL_LM"))  # fmt: skip


EXPERT_STACKS = ("gate_up_proj", "down_proj")  # the packed stacks' parameter names (under peft's base_layer)


def stored_bytes(p) -> int:
    """Bytes a parameter holds: an NF4 expert stack's packed bytes and scales, else its elements."""
    return p.nbytes_stored() if hasattr(p, "nbytes_stored") else p.numel() * p.element_size()


def quantization(args, dtype):
    if not args.four_bit:
        return None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=dtype)  # fmt: skip


def bench_step(args) -> None:
    import os
    import tempfile

    name = "tiny" if args.tiny else args.shape
    path = build_model_dir(name, args.layers, args.tiny, os.path.join(tempfile.gettempdir(), f"moe-{name}-{args.layers}"))
    if device() == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model = load(args.impl, path, args)
    load_peak = torch.cuda.max_memory_allocated() / 2**30 if device() == "cuda" else 0.0
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    batch, seq = (2, 16) if args.tiny else (args.batch, args.seq)
    g = torch.Generator().manual_seed(0)
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (batch, seq), generator=g).to(device())
    times, losses = [], []
    if device() == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i in range(args.warmup + args.steps):
        if device() == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device() == "cuda":
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
        losses.append(round(loss.item(), 4))
    peak = torch.cuda.max_memory_allocated() / 2**30 if device() == "cuda" else 0.0
    experts_gib = sum(stored_bytes(p) for n, p in model.named_parameters() if n.rsplit(".", 1)[-1] in EXPERT_STACKS) / 2**30
    print(json.dumps({"part": "step", "shape": name, "impl": args.impl, "layers": args.layers,
                      "four_bit": args.four_bit, "batch": batch, "seq": seq, "median_step_s": round(statistics.median(times), 4),
                      "peak_gib": round(peak, 2), "load_peak_gib": round(load_peak, 2), "expert_stacks_gib": round(experts_gib, 3), "losses": losses}), flush=True)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=["kernel", "step", "tune"], default="kernel")
    p.add_argument("--budget-s", type=float, default=200, help="(tune) stop sweeping after this many seconds")
    p.add_argument("--impl", choices=["ours", "unsloth", "hf"], default="ours", help="(step) whose training step")
    p.add_argument("--only", choices=["triton", "torch"], help="(kernel) time one implementation only")
    p.add_argument("--shape", choices=sorted(SHAPES), default="gpt-oss-20b", help="(step) model shapes")
    p.add_argument("--layers", type=int, default=2, help="(step) decoder layers (the full models: 24 and 48)")
    p.add_argument("--four-bit", action="store_true", help="(step) QLoRA: NF4 base weights")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="tiny shapes, CPU ok (TRITON_INTERPRET=1): checks the code")
    args = p.parse_args()
    if args.tiny:
        args.steps, args.warmup = 1, 0
    {"kernel": bench_kernel, "step": bench_step, "tune": bench_tune}[args.part](args)


if __name__ == "__main__":
    sys.exit(main())
