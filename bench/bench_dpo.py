"""DPO with QLoRA on Llama-3.1-8B shapes: ours, public Unsloth, and TRL + PEFT, on identical batches.

Each impl is its own process (the public Unsloth answers `import unsloth` too) and runs TRL's
DPOTrainer for --warmup + --steps steps over the same random-token pairs (a word-level tokenizer
whose words are the token ids, so every impl tokenizes to the same ids; the same seed, so the same
batch order). Printed: one JSON line per impl with the median step time of the timed steps, the
peak GPU memory (torch.cuda.max_memory_allocated) and the losses of every step (equal batches, so
the losses are comparable to TRL + PEFT's within rounding).

    python3 bench/bench_dpo.py --impl make                 # the model folder (random weights), once
    python3 bench/bench_dpo.py --impl ours                 # our package first on PYTHONPATH
    PYTHONPATH=<anchors only> python3 bench/bench_dpo.py --impl unsloth   # public Unsloth + PatchDPOTrainer
    PYTHONPATH=<anchors only> python3 bench/bench_dpo.py --impl trl       # transformers + bitsandbytes + PEFT
    python3 bench/bench_dpo.py --tiny --impl ours          # a tiny model on the CPU (code-path check)

Shapes: Llama-3.1-8B (hidden 4096, 32 heads / 8 KV heads, MLP 14336, vocab 128256), with --layers
decoder layers (default 8, not 32, so that making, quantizing and three runs fit one ~4 minute
device call; the LM head, where the fused log-probabilities matter, is full size). Batch: 2 pairs
(4 sequences) of --seq tokens, a quarter of them prompt.
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
p.add_argument("--impl", choices=["make", "ours", "unsloth", "trl"], required=True)
p.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "llama8b-dpo"))
p.add_argument("--layers", type=int, default=8)
p.add_argument("--pairs", type=int, default=2, help="preference pairs per batch (each is 2 sequences)")
p.add_argument("--seq", type=int, default=1024)
p.add_argument("--steps", type=int, default=4)
p.add_argument("--warmup", type=int, default=2)
p.add_argument("--rank", type=int, default=16)
p.add_argument("--tiny", action="store_true", help="tiny Llama on the CPU, fp32, no 4-bit: checks the code path")
args = p.parse_args()
if args.impl == "ours":  # our source first (the anchors' site also holds the public `unsloth`)
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    sys.path[:0] = [os.path.join(root, "src"), os.path.join(root, "kernels")]

import torch  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if args.tiny:
    args.model_dir += "-tiny"
    args.seq = min(args.seq, 64)


def make() -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if args.tiny:
        shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
    else:
        shape = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=args.layers,
                     num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0)
    config = LlamaConfig(**shape, max_position_embeddings=4096, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                         tie_word_embeddings=False, torch_dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(config).to(torch.float32 if args.tiny else torch.bfloat16)
    model.save_pretrained(args.model_dir)
    vocab = {f"t{i}": i for i in range(shape["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t0", eos_token="t1", pad_token="t2",
                            unk_token="t3").save_pretrained(args.model_dir)
    print(json.dumps({"made": args.model_dir, "layers": shape["num_hidden_layers"]}))


def dataset(vocab: int):
    """Pairs of random-token texts: a prompt of a quarter of --seq, chosen and rejected of the rest."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(1)
    prompt_len = args.seq // 4
    answer_len = args.seq - prompt_len - 1  # room for the EOS TRL appends
    rows = []
    for _ in range(args.pairs * (args.warmup + args.steps)):
        ids = torch.randint(4, min(vocab, 128000), (prompt_len + 2 * answer_len,), generator=g).tolist()
        text = lambda part: " ".join(f"t{i}" for i in part)  # noqa: E731
        rows.append({"prompt": text(ids[:prompt_len]), "chosen": " " + text(ids[prompt_len:prompt_len + answer_len]),
                     "rejected": " " + text(ids[prompt_len + answer_len:])})
    return Dataset.from_list(rows)


def load():
    dtype = torch.float32 if args.tiny else torch.bfloat16
    if args.impl in ("ours", "unsloth"):
        from unsloth import FastLanguageModel, PatchDPOTrainer

        PatchDPOTrainer()
        model, tokenizer = FastLanguageModel.from_pretrained(args.model_dir, max_seq_length=args.seq, dtype=dtype,
                                                             load_in_4bit=not args.tiny, local_files_only=True)
        model = FastLanguageModel.get_peft_model(model, r=args.rank, lora_alpha=args.rank, lora_dropout=0,
                                                 bias="none", target_modules=TARGETS,
                                                 use_gradient_checkpointing="unsloth", random_state=0)
        return model, tokenizer
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    quantization = None if args.tiny else BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_use_double_quant=True)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype, quantization_config=quantization,
                                                 device_map={"": DEVICE})
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=args.rank, lora_dropout=0.0, bias="none",
                                             target_modules=TARGETS, task_type="CAUSAL_LM"))
    return model, AutoTokenizer.from_pretrained(args.model_dir)


def run() -> dict:
    from transformers import TrainerCallback

    model, tokenizer = load()
    from trl import DPOConfig, DPOTrainer  # after `from unsloth import ...`, as in the notebooks

    times = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.start)

    config = DPOConfig(output_dir=os.path.join(tempfile.gettempdir(), f"dpo-{args.impl}"), beta=0.1,
                       per_device_train_batch_size=args.pairs, max_steps=args.warmup + args.steps,
                       learning_rate=5e-6, logging_steps=1, save_strategy="no", report_to="none",
                       bf16=not args.tiny, max_length=args.seq, seed=0, optim="adamw_torch",
                       gradient_checkpointing=args.impl == "trl", lr_scheduler_type="constant")
    trainer = DPOTrainer(model=model, ref_model=None, args=config, train_dataset=dataset(len(tokenizer)),
                         processing_class=tokenizer, callbacks=[Timer()])
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    losses = [round(log["loss"], 6) for log in trainer.state.log_history if "loss" in log]
    return {"impl": args.impl, "bench": "dpo", "layers": "tiny" if args.tiny else args.layers, "pairs": args.pairs,
            "seq": args.seq, "median_step_s": round(statistics.median(times[args.warmup:]), 4),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if DEVICE == "cuda" else None,
            "losses": losses, "fused_log_probs": bool(getattr(trainer, "_unsloth_fused_log_probs", False))}


if __name__ == "__main__":
    if args.impl == "make":
        make()
    else:
        try:
            print(json.dumps(run()))
        except Exception as exc:  # noqa: BLE001 - one JSON line either way, for the table
            print(json.dumps({"impl": args.impl, "bench": "dpo", "error": f"{type(exc).__name__}: {exc}"[:500]}))
            raise
