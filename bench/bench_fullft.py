"""Full fine-tuning of a Llama-3.2-1B-shaped model (bf16, batch 8 x 2048, adamw_8bit as Unsloth's
notebook uses), and 8-bit LoRA rows (--mode lora8): ours, the public Unsloth or transformers (+ PEFT).

One implementation per process (they patch transformers globally); `import unsloth` finds ours or
the public one by PYTHONPATH, as in bench_notebook_sft.py. Every implementation gets the same model
folder (random weights, written once by --impl make), the same random batches (a CUDA generator
seeded 1) and the same loop: forward with labels, backward, optimizer step, zero_grad. One JSON
line: median step after the warm-up, peak = torch.cuda.max_memory_allocated (weights included),
the losses of every step, and for ours the memory estimate made before training (training/memory.py).

    ROOT=$PWD
    python3 bench/bench_fullft.py --impl make                       # /tmp/llama1b, once (~30 s)
    PYTHONPATH=/tmp/site:$ROOT/src:$ROOT/kernels:$ROOT/.anchors/site python3 bench/bench_fullft.py --impl ours
    PYTHONPATH=/tmp/site:$ROOT/.anchors/site python3 bench/bench_fullft.py --impl unsloth
    PYTHONPATH=/tmp/site:$ROOT/.anchors/site python3 bench/bench_fullft.py --impl hf
    ... --mode lora8 --batch 2                                       # 8-bit LoRA rows
    PYTHONPATH=src:kernels TRITON_INTERPRET=1 python3 bench/bench_fullft.py --tiny --impl ours   # CPU code path
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

p = argparse.ArgumentParser()
p.add_argument("--impl", required=True, choices=["ours", "unsloth", "hf", "make"])
p.add_argument("--mode", default="full", choices=["full", "lora8"], help="full fine-tuning, or LoRA on 8-bit weights")
p.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "llama1b"))
p.add_argument("--batch", type=int, default=8)
p.add_argument("--seq", type=int, default=2048)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--warmup", type=int, default=2)
p.add_argument("--optim", default="adamw_8bit", choices=["adamw_8bit", "adamw"])
p.add_argument("--lr", type=float, default=2e-5)
p.add_argument("--rank", type=int, default=16)
p.add_argument("--tiny", action="store_true", help="a tiny random Llama, CPU ok: checks the code path only")
args = p.parse_args()

if args.impl in ("ours", "unsloth"):
    import unsloth  # noqa: F401  (first, as in the notebooks: ours or the public one, by PYTHONPATH)

import torch  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


def llama_1b_config(tiny: bool):
    from transformers import LlamaConfig

    if tiny:
        return LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                           bos_token_id=0, eos_token_id=1, tie_word_embeddings=True)
    # Llama-3.2-1B's config.json: 16 layers, hidden 2048, MLP 8192, 32 / 8 heads of 64, tied embeddings
    return LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling={"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        bos_token_id=128000, eos_token_id=128001, torch_dtype="bfloat16")


def make_model(path: str, tiny: bool) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    config = llama_1b_config(tiny)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(config).to(DTYPE)
    model.save_pretrained(path, safe_serialization=True)
    vocab = config.vocab_size
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t0", eos_token="t1", pad_token="t2",
                            unk_token="t0").save_pretrained(path)
    print(json.dumps({"made": path, "parameters": sum(q.numel() for q in model.parameters())}), flush=True)


def load_fast():
    """Ours or the public Unsloth, through the notebooks' calls."""
    from unsloth import FastLanguageModel

    common = dict(model_name=args.model_dir, max_seq_length=args.seq, dtype=DTYPE, load_in_4bit=False,
                  local_files_only=True)
    if args.mode == "full":
        model, _ = FastLanguageModel.from_pretrained(**common, full_finetuning=True,
                                                     use_gradient_checkpointing="unsloth")
    else:
        model, _ = FastLanguageModel.from_pretrained(**common, load_in_8bit=True)
        model = FastLanguageModel.get_peft_model(
            model, r=args.rank, lora_alpha=args.rank, lora_dropout=0, bias="none", target_modules=TARGETS,
            use_gradient_checkpointing="unsloth", random_state=0)
    FastLanguageModel.for_training(model)
    return model


def load_hf():
    """transformers (+ PEFT and bitsandbytes for lora8), SDPA, its own gradient checkpointing."""
    from transformers import AutoModelForCausalLM

    kw = dict(dtype=DTYPE, attn_implementation="sdpa", device_map=DEVICE)
    if args.mode == "lora8":
        from transformers import BitsAndBytesConfig

        kw["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, **kw)
    if args.mode == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        model.train()
        return model
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True,
                                            gradient_checkpointing_kwargs={"use_reentrant": False})
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=args.rank, lora_dropout=0.0, bias="none",
                                             target_modules=TARGETS, task_type="CAUSAL_LM"))
    model.train()
    return model


def optimizer_for(params):
    if args.optim == "adamw_8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=args.lr)
    return torch.optim.AdamW(params, lr=args.lr, fused=DEVICE == "cuda")


def our_estimate(model) -> float | None:
    """Our pre-training estimate of this run (only our package has it)."""
    if args.impl != "ours":
        return None
    from unsloth.training.memory import RunSettings, estimate, model_facts

    settings = RunSettings(batch=args.batch, seq=args.seq, optim=args.optim if args.optim != "adamw" else "adamw_torch",
                           checkpointing="unsloth", offload=DEVICE == "cuda")
    return round(estimate(model_facts(model), settings).total / 2**30, 2)


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    if args.tiny:
        args.model_dir = tempfile.mkdtemp(prefix="tiny-llama1b-")
        args.batch, args.seq, args.steps, args.warmup = 2, 32, 2, 1
        make_model(args.model_dir, tiny=True)
    if args.impl == "make":
        if not args.tiny:
            make_model(args.model_dir, tiny=False)
        return
    if not os.path.isdir(args.model_dir):
        sys.exit(f"{args.model_dir}: no model; run `python3 bench/bench_fullft.py --impl make` first")
    t_load = time.perf_counter()
    model = load_hf() if args.impl == "hf" else load_fast()
    t_load = time.perf_counter() - t_load
    params = [q for q in model.parameters() if q.requires_grad]
    optimizer = optimizer_for(params)
    estimate_gib = our_estimate(model)
    vocab = model.config.vocab_size
    g = torch.Generator(device=DEVICE).manual_seed(1)
    sync()
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    from profiling import kernel_profile  # BENCH_PROFILE=1: the last step's kernels

    times, losses = [], []
    for i in range(args.warmup + args.steps):
        ids = torch.randint(0, min(vocab, 128000), (args.batch, args.seq), device=DEVICE, generator=g)
        sync()
        t0 = time.perf_counter()
        with kernel_profile(f"fullft {args.impl}", enabled=i == args.warmup + args.steps - 1):
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        sync()
        losses.append(float(out.loss))
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    report = getattr(base, "_unsloth_patches", None)
    print(json.dumps({
        "bench": "fullft", "impl": args.impl, "mode": args.mode, "optim": args.optim, "batch": args.batch,
        "seq": args.seq, "median_step_s": round(med, 4), "min_step_s": round(min(times), 4),
        "tokens_per_s": round(args.batch * args.seq / med, 1),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if DEVICE == "cuda" else None,
        "estimate_gib": estimate_gib, "load_s": round(t_load, 1), "losses": [round(x, 4) for x in losses],
        "trainable": sum(q.numel() for q in params), "param_dtype": str(params[0].dtype),
        "patches": report.summary() if report is not None and hasattr(report, "summary") else None,
        "unsloth": os.path.dirname(unsloth.__file__) if args.impl != "hf" else None, "device": DEVICE,
    }), flush=True)


if __name__ == "__main__":
    main()
