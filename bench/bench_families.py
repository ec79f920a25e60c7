"""Today's families on the anchor harness's loop: ours, Unsloth or transformers + PEFT, one per process.

    python3 bench/bench_families.py --family qwen3_5 --shape qlora --impl make     # writes the model once
    python3 bench/bench_families.py --family qwen3_5 --shape qlora --impl ours [--generic]
    python3 bench/bench_families.py --family qwen3_5 --shape qlora --impl unsloth  # the public package
    python3 bench/bench_families.py --family qwen3_5 --shape qlora --impl hf

Random weights at transformers' default sizes for each family (Qwen3.5: the default text config;
Gemma 4: the default text config, the towers of the multimodal one take no part in text training;
Phi-4-mini's family phi3: Phi3Config's defaults), with fewer layers than the default so that one run
fits 60-90 s on an H200: `layers` and `default_layers` in the output say how many. Shapes: QLoRA
(NF4) batch 2 x 2048, bf16 LoRA batch 8 x 2048; LoRA r 16 on the attention and MLP projections.
The loop is anchor_lora.py's: forward with labels, backward, fused AdamW, median of the steps after
the warm-up, peak = torch.cuda.max_memory_allocated(). One JSON line; `losses` are the per-step
losses on the same seeded batches in every implementation, so they compare directly.
`--generic` switches family patches off (UNSLOTH_FAMILY_PATCHES=0): the generic fast path alone.
`--shape qlora,bf16` measures both shapes in one process (one import, Unsloth's compile cache warm
for the second). `load_s` and `warmup_s` report loading (Unsloth compiles its blocks there) and the
warm-up steps apart from the median. bench/h200.sh's `families_call` runs the row set for one call.
`--tiny`: a CPU-sized model of the family (kernels under TRITON_INTERPRET=1) to check the code path.
`ours` and `unsloth` both `import unsloth`: PYTHONPATH decides which (bench/h200.sh families sets it;
the output's `unsloth_from` shows it).
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
p.add_argument("--impl", required=True, choices=["make", "ours", "unsloth", "hf"])
p.add_argument("--family", required=True, choices=["qwen3_5", "gemma4", "phi3"])
p.add_argument("--shape", default="qlora", help="qlora, bf16 or both comma-separated (one process, one line each)")
p.add_argument("--layers", type=int, default=None, help="decoder layers (default: BENCH_LAYERS[family])")
p.add_argument("--generic", action="store_true", help="family patches off: the generic fast path alone")
p.add_argument("--steps", type=int, default=5)
p.add_argument("--warmup", type=int, default=2)
p.add_argument("--seq", type=int, default=2048)
p.add_argument("--rank", type=int, default=16)
p.add_argument("--tiny", action="store_true", help="a CPU-sized model, to check the code path")
p.add_argument("--model-dir", default=None)
args = p.parse_args()

if args.generic:
    os.environ["UNSLOTH_FAMILY_PATCHES"] = "0"
if args.impl in ("ours", "unsloth"):
    import unsloth  # noqa: F401  (before transformers, as Unsloth asks)

import torch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
SHAPES = args.shape.split(",")
if not set(SHAPES) <= {"qlora", "bf16"}:
    p.error(f"--shape: qlora and/or bf16, not {args.shape!r}")
BATCH = {"qlora": 2, "bf16": 8}
# Layers per run: at the default sizes these fit a run (load, 7 steps) in about a minute.
BENCH_LAYERS = {"qwen3_5": 8, "gemma4": 10, "phi3": 12}
TARGETS = {
    "qwen3_5": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gemma4": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
}
TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


def family_config(layers: int | None):
    import transformers as t

    tiny = TINY if args.tiny else {}
    if args.family == "qwen3_5":
        extra = dict(head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                     linear_num_value_heads=4) if args.tiny else {}
        default = t.Qwen3_5TextConfig().num_hidden_layers
        config = t.Qwen3_5TextConfig(**tiny, **extra, num_hidden_layers=layers or default)
    elif args.family == "gemma4":
        extra = dict(head_dim=16, vocab_size_per_layer_input=300, hidden_size_per_layer_input=8) if args.tiny else {}
        default = t.Gemma4TextConfig().num_hidden_layers
        n = layers or default
        config = t.Gemma4TextConfig(**tiny, **extra, num_hidden_layers=n,
                                    layer_types=None if n == default else _gemma4_layer_types(n))
    else:
        default = t.Phi3Config().num_hidden_layers
        config = t.Phi3Config(**tiny, num_hidden_layers=layers or default, pad_token_id=None)
    return config, default


def _gemma4_layer_types(n: int) -> list[str]:
    """Gemma 4's pattern (five sliding layers, then a full one) cut to n layers, ending on a full one."""
    types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
    types[-1] = "full_attention"
    return types


def model_dir() -> str:
    if args.model_dir:
        return args.model_dir
    size = "tiny" if args.tiny else f"{layers()}l"
    return os.path.join(tempfile.gettempdir(), f"bench-{args.family}-{size}")


def layers() -> int:
    return args.layers or (2 if args.tiny else BENCH_LAYERS[args.family])


def make(path: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    config, _ = family_config(layers())
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if DEVICE == "cuda" else torch.float32)
    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(config.vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1", pad_token="t2", unk_token="t0").save_pretrained(path)
    print(json.dumps({"made": path, "family": args.family, "layers": layers(),
                      "params": sum(q.numel() for q in model.parameters())}))


def load(impl: str, path: str, shape: str):
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    four_bit = shape == "qlora"
    if impl in ("ours", "unsloth"):
        from unsloth import FastLanguageModel

        model, _ = FastLanguageModel.from_pretrained(model_name=path, max_seq_length=args.seq, dtype=dtype,
                                                     load_in_4bit=four_bit, local_files_only=True)
        model = FastLanguageModel.get_peft_model(
            model, r=args.rank, lora_alpha=args.rank, lora_dropout=0, bias="none",
            target_modules=TARGETS[args.family], use_gradient_checkpointing="unsloth", random_state=0)
        FastLanguageModel.for_training(model)
        return model
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM

    kw = dict(dtype=dtype, device_map=DEVICE)
    if four_bit:
        from transformers import BitsAndBytesConfig

        kw["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                       bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(path, **kw)
    if four_bit:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True,
                                                gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=args.rank, lora_dropout=0.0, bias="none",
                                             target_modules=TARGETS[args.family], task_type="CAUSAL_LM"))
    model.train()
    return model


def main() -> None:
    path = model_dir()
    if args.impl == "make" or (args.tiny and not os.path.isdir(path)):
        make(path)
        if args.impl == "make":
            return
    if not os.path.isdir(path):
        sys.exit(f"{path}: no model; run `bench/bench_families.py --family {args.family} --impl make` first")
    for shape in SHAPES:  # one line per shape as soon as it is measured, so a timeout keeps the first
        measure(path, shape)


def measure(path: str, shape: str) -> None:
    import gc

    t_load = time.perf_counter()
    model = load(args.impl, path, shape)  # Unsloth compiles its decoder blocks here: in load_s, not the steps
    t_load = time.perf_counter() - t_load
    config = model.get_base_model().config if hasattr(model, "get_base_model") else model.config
    vocab = config.get_text_config().vocab_size
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-4, fused=DEVICE == "cuda")
    batch, seq = (2, 32) if args.tiny else (BATCH[shape], args.seq)
    g = torch.Generator(device=DEVICE).manual_seed(1)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, warmup_times, losses = [], [], []
    steps, warmup = (2, 1) if args.tiny else (args.steps, args.warmup)
    for i in range(warmup + steps):
        ids = torch.randint(0, vocab, (batch, seq), device=DEVICE, generator=g)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        losses.append(float(out.loss))
        (times if i >= warmup else warmup_times).append(time.perf_counter() - t0)
    report = getattr(model.get_base_model(), "_unsloth_patches", None)
    med = statistics.median(times)
    print(json.dumps({
        "impl": args.impl + ("-generic" if args.generic else ""), "family": args.family, "shape": shape,
        "batch": batch, "seq": seq, "layers": config.get_text_config().num_hidden_layers,
        "default_layers": family_config(None)[1], "median_step_s": round(med, 4),
        "tokens_per_s": round(batch * seq / med, 1),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if DEVICE == "cuda" else None,
        # load_s holds Unsloth's block compile; warmup_s its (and our) first steps' compile: neither is in the median
        "load_s": round(t_load, 1), "warmup_s": [round(x, 2) for x in warmup_times],
        "losses": [round(x, 4) for x in losses],
        "trainable": sum(q.numel() for q in params), "device": DEVICE,
        "unsloth_from": getattr(sys.modules.get("unsloth"), "__file__", None),
        "patches": report.summary() if report is not None and hasattr(report, "summary") else None,
    }), flush=True)
    del model, opt, params, out
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
