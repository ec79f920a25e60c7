"""Our trainer on the anchor harness's shapes: one LoRA / QLoRA step on a Llama-3.1-8B-shaped model.

Matches ../shared/anchors/anchor_lora.py exactly (same model folder written by its `--impl make`,
same random batches from a CUDA generator seeded 1, same loop: forward with labels, backward, fused
AdamW step; median of --steps after --warmup; peak = torch.cuda.max_memory_allocated) and prints
one JSON line in the same format, impl "ours". Run it in the same device call as the anchors:

    python3 bench/bench_trainer.py                              # bf16 LoRA, 8 x 2048
    python3 bench/bench_trainer.py --four-bit --batch 2         # QLoRA (needs bitsandbytes)
    python3 bench/bench_trainer.py --check-loss                 # + transformers + PEFT on the same batches
    python3 bench/bench_trainer.py --profile                    # + GPU time by category (anchor categories)
    python3 bench/bench_trainer.py --tiny                       # a tiny model, runs on the CPU (code-path check)

On the CPU (--tiny, TRITON_INTERPRET=1) a --four-bit --check-loss run differs by about 1e-2 after
the first step: bitsandbytes' own CPU 4-bit matmul rounds (about 2e-3 off x @ dequantized W), while
our path multiplies by the exactly dequantized weight. On a GPU both dequantize exactly.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kernels"))

p = argparse.ArgumentParser()
p.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "llama8b"))
p.add_argument("--batch", type=int, default=8)
p.add_argument("--seq", type=int, default=2048)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--warmup", type=int, default=2)
p.add_argument("--rank", type=int, default=16)
p.add_argument("--four-bit", action="store_true")
p.add_argument("--checkpointing", default="unsloth", help='True, False or "unsloth" (offloaded)')
p.add_argument("--check-loss", action="store_true", help="also run transformers + PEFT on the same batches")
p.add_argument("--profile", action="store_true", help="profile one step after the timed ones")
p.add_argument("--tiny", action="store_true", help="tiny random Llama, CPU ok: checks the code path only")
args = p.parse_args()

import torch  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB_DRAW = 128000  # the anchors draw token ids below this


def make_tiny(path: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(512)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t0", eos_token="t1", pad_token="t2").save_pretrained(path)


def checkpointing_mode(text: str):
    return {"true": True, "false": False}.get(text.lower(), text)


def load_ours():
    from unsloth import FastLanguageModel

    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    model, _ = FastLanguageModel.from_pretrained(
        model_name=args.model_dir, max_seq_length=args.seq, dtype=dtype, load_in_4bit=args.four_bit,
        local_files_only=True)
    model = FastLanguageModel.get_peft_model(
        model, r=args.rank, lora_alpha=args.rank, lora_dropout=0, bias="none", target_modules=TARGETS,
        use_gradient_checkpointing=checkpointing_mode(args.checkpointing), random_state=0)
    FastLanguageModel.for_training(model)
    return model


def load_reference():
    """transformers + PEFT as the anchor's "hf" implementation builds it (for the loss check)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    kw = dict(dtype=dtype, attn_implementation="sdpa", device_map=DEVICE)
    if args.four_bit:
        from transformers import BitsAndBytesConfig

        kw["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                       bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, **kw)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=args.rank, lora_dropout=0.0, bias="none",
                                             target_modules=TARGETS, task_type="CAUSAL_LM"))
    model.train()
    return model


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def run(model, steps: int, warmup: int):
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-4, fused=DEVICE == "cuda")
    g = torch.Generator(device=DEVICE).manual_seed(1)
    sync()
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for i in range(warmup + steps):
        ids = torch.randint(0, min(VOCAB_DRAW, model.config.vocab_size), (args.batch, args.seq), device=DEVICE,
                            generator=g)
        sync()
        t0 = time.perf_counter()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        dt = time.perf_counter() - t0
        losses.append(float(out.loss))
        if i >= warmup:
            times.append(dt)
    peak = torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else None
    return times, losses, peak, opt


def profile_step(model, opt) -> dict:
    """GPU time of one step by the anchor's categories (see ../shared/anchors/profile_step.py)."""
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(0, min(VOCAB_DRAW, model.config.vocab_size), (args.batch, args.seq), device=DEVICE)
    sync()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()

    def category(name: str) -> str:
        k = name.lower()
        if any(s in k for s in ("flash", "fmha", "attention", "sdpa")):
            return "attention"
        if any(s in k for s in ("gemm", "gemv", "cutlass", "sm90", "nvjet", "matmul")):
            return "matmul"
        if any(s in k for s in ("dequant", "4bit")):
            return "dequant"
        if "memcpy" in k or "memset" in k:
            return "copy/memset"
        if "adam" in k:
            return "optimizer"
        if k.startswith("_") or "triton" in k:  # our Triton kernels are named after their jit functions
            return "triton"
        return "elementwise/other"

    totals = collections.Counter()
    for e in prof.key_averages():
        if e.device_time_total > 0 and e.device_type.name == "CUDA":
            totals[category(e.key)] += e.device_time_total
    return {k: round(v / 1e3, 1) for k, v in totals.most_common()}


def main() -> None:
    if args.tiny:
        args.model_dir = tempfile.mkdtemp(prefix="tiny-llama-")
        args.batch, args.seq, args.steps, args.warmup = 2, 32, 2, 1
        make_tiny(args.model_dir)
    elif not os.path.isdir(args.model_dir):
        sys.exit(f"{args.model_dir}: no model; run `python3 .anchors/anchor_lora.py --impl make` first")
    t_load = time.perf_counter()
    model = load_ours()
    t_load = time.perf_counter() - t_load
    report = model.get_base_model()._unsloth_patches
    times, losses, peak, opt = run(model, args.steps, args.warmup)
    med = statistics.median(times)
    result = {
        "impl": "ours", "four_bit": args.four_bit, "batch": args.batch, "seq": args.seq, "rank": args.rank,
        "layers": model.config.num_hidden_layers, "median_step_s": round(med, 4),
        "min_step_s": round(min(times), 4), "max_step_s": round(max(times), 4),
        "tokens_per_s": round(args.batch * args.seq / med, 1),
        "peak_gib": None if peak is None else round(peak, 2), "load_s": round(t_load, 1),
        "losses": [round(x, 3) for x in losses],
        "trainable": sum(q.numel() for q in model.parameters() if q.requires_grad),
        "patches": report.summary(), "checkpointing": args.checkpointing, "device": DEVICE,
    }
    if args.profile and DEVICE == "cuda":
        result["by_category_ms"] = profile_step(model, opt)
    if args.check_loss:
        del model, opt
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        _, ref_losses, _, _ = run(load_reference(), args.steps, args.warmup)
        result["reference_losses"] = [round(x, 3) for x in ref_losses]
        result["max_loss_diff"] = round(max(abs(a - b) for a, b in zip(losses, ref_losses)), 4)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
