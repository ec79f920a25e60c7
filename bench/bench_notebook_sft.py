"""A notebook-style TRL SFTTrainer run (Llama-3.1-8B shapes, QLoRA, batch 2 x grad-accum 4, adamw_8bit,
2048 tokens): ours or the public Unsloth, whichever `import unsloth` finds first on PYTHONPATH.

The cells are the notebooks' own: FastLanguageModel.from_pretrained(load_in_4bit=True) ->
get_peft_model(r=16, the seven projections, use_gradient_checkpointing="unsloth") ->
SFTTrainer(model=, tokenizer=, train_dataset=, args=SFTConfig(...)) -> trainer.train(). The data are
random token ids (seeded), pre-tokenized, every row 2048 long. The model folder is the anchors' one
(`.anchors/anchor_lora.py --impl make` writes /tmp/llama8b with random weights). One JSON line:
median optimizer-step time after the warm-up steps and peak allocated memory.

    ROOT=$PWD
    python3 .anchors/anchor_lora.py --impl make >/dev/null
    PYTHONPATH=/tmp/site:$ROOT/src:$ROOT/kernels:$ROOT/.anchors/site python3 bench/bench_notebook_sft.py --impl ours
    PYTHONPATH=/tmp/site:$ROOT/.anchors/site python3 bench/bench_notebook_sft.py --impl unsloth
    UNSLOTH_KERNELS=0 python3 bench/bench_notebook_sft.py --tiny     # the code path on a CPU, in seconds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

p = argparse.ArgumentParser()
p.add_argument("--impl", default="ours", help="a label for the JSON line: ours | unsloth")
p.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "llama8b"))
p.add_argument("--seq", type=int, default=2048)
p.add_argument("--batch", type=int, default=2)
p.add_argument("--grad-accum", type=int, default=4)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--warmup", type=int, default=2)
p.add_argument("--optim", default="adamw_8bit")
p.add_argument("--tiny", action="store_true", help="a tiny random Llama on the CPU: checks the code path only")
args = p.parse_args()

import unsloth  # noqa: E402  (first, as in the notebooks)
from unsloth import FastLanguageModel  # noqa: E402

import torch  # noqa: E402

CUDA = torch.cuda.is_available()


def make_tiny(path: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    LlamaForCausalLM(cfg).save_pretrained(path)


def ensure_tokenizer(path: str) -> None:
    """from_pretrained loads a tokenizer; the anchors' folder has none, and the data are token ids:
    a minimal word-level one is written beside the weights."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    if os.path.exists(os.path.join(path, "tokenizer.json")) or os.path.exists(os.path.join(path, "tokenizer.model")):
        return
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")),
                            pad_token="<pad>", bos_token="<s>", eos_token="</s>").save_pretrained(path)


def main() -> None:
    from datasets import Dataset
    from profiling import step_timer
    from trl import SFTConfig, SFTTrainer

    if args.tiny:
        args.model_dir = tempfile.mkdtemp(prefix="tiny-llama-")
        make_tiny(args.model_dir)
        args.seq, args.steps, args.warmup = 64, 2, 1
        args.optim = "adamw_torch" if not CUDA else args.optim
    ensure_tokenizer(args.model_dir)
    model, tokenizer = FastLanguageModel.from_pretrained(model_name=args.model_dir, max_seq_length=args.seq, dtype=None,
                                                 load_in_4bit=not args.tiny)
    model = FastLanguageModel.get_peft_model(
        model, r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        lora_alpha=16, lora_dropout=0, bias="none", use_gradient_checkpointing="unsloth", random_state=3407)
    steps = args.warmup + args.steps
    vocab = min(model.get_input_embeddings().weight.shape[0], 128000)
    generator = torch.Generator().manual_seed(1)
    rows = args.batch * args.grad_accum * steps
    ids = torch.randint(3, vocab, (rows, args.seq), generator=generator).tolist()
    dataset = Dataset.from_dict({"input_ids": ids})

    times: list[float] = []

    out = tempfile.mkdtemp(prefix="nb-sft-")
    trainer = SFTTrainer(
        model=model, tokenizer=tokenizer, train_dataset=dataset, callbacks=[step_timer(times, args.warmup)],
        args=SFTConfig(per_device_train_batch_size=args.batch, gradient_accumulation_steps=args.grad_accum,
                       warmup_steps=1, max_steps=steps, learning_rate=2e-4, logging_steps=1, optim=args.optim,
                       weight_decay=0.001, lr_scheduler_type="linear", seed=3407, output_dir=out,
                       report_to="none", save_strategy="no", max_length=args.seq, packing=False,
                       bf16=CUDA and torch.cuda.is_bf16_supported(),
                       fp16=CUDA and not torch.cuda.is_bf16_supported()))
    trainer.train()
    timed = times[args.warmup:]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print(json.dumps({
        "bench": "notebook_sft", "impl": args.impl, "unsloth": os.path.dirname(unsloth.__file__),
        "shape": f"qlora b{args.batch}x{args.grad_accum} s{args.seq}" if not args.tiny else "tiny",
        "step_s": round(statistics.median(timed), 4), "steps": len(timed),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if CUDA else None,
        "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
    }))


main()
