"""An Orpheus-3B-shaped TTS SFT, as the Unsloth Orpheus notebook runs it: ours or the public Unsloth,
whichever `import unsloth` finds first on PYTHONPATH.

The model is Llama-3.2-3B's shape with Orpheus's vocabulary (156940: Llama 3's text ids, speech
markers, 7 x 4096 SNAC audio ids), random weights in bf16 (`--impl make` writes it once to
/tmp/orpheus3b; `--layers` makes it shallower, said in the JSON line). The cells are the notebook's:
FastLanguageModel.from_pretrained(load_in_4bit=False) -> get_peft_model(r=64, alpha=64, the seven
projections, use_gradient_checkpointing="unsloth") -> transformers' Trainer with batch 1 x grad-accum
4, adamw_8bit, lr 2e-4. Rows are laid out as the notebook lays them (human turn of text ids, then
start_of_speech, whole 7-token frames of audio ids, end_of_speech) with random ids, `--seq` long,
labels = ids. One JSON line: median optimizer-step time after the warm-up steps, peak allocated memory.

    ROOT=$PWD
    PYTHONPATH=/tmp/site:$ROOT/src:$ROOT/kernels:$ROOT/.anchors/site python3 bench/bench_tts.py --impl make
    PYTHONPATH=/tmp/site:$ROOT/src:$ROOT/kernels:$ROOT/.anchors/site python3 bench/bench_tts.py --impl ours
    PYTHONPATH=/tmp/site:$ROOT/.anchors/site python3 bench/bench_tts.py --impl unsloth
    UNSLOTH_KERNELS=0 python3 bench/bench_tts.py --tiny      # the code path on a CPU, in seconds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

p = argparse.ArgumentParser()
p.add_argument("--impl", default="ours", help="make (write the model) | a label for the JSON line: ours | unsloth")
p.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "orpheus3b"))
p.add_argument("--layers", type=int, default=28, help="decoder layers (Llama-3.2-3B has 28)")
p.add_argument("--seq", type=int, default=2048)
p.add_argument("--batch", type=int, default=1)
p.add_argument("--grad-accum", type=int, default=4)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--warmup", type=int, default=2)
p.add_argument("--optim", default="adamw_8bit")
p.add_argument("--tiny", action="store_true", help="a tiny random Llama on the CPU: checks the code path only")
args = p.parse_args()

# Orpheus 3B's ids (the notebook's constants): text vocabulary, markers after it, audio from 128266.
TEXT_VOCAB, END_OF_TEXT, CODEBOOK = 128256, 128009, 4096
if args.tiny:
    TEXT_VOCAB, END_OF_TEXT, CODEBOOK = 256, 2, 64
START_OF_SPEECH, END_OF_SPEECH = TEXT_VOCAB + 1, TEXT_VOCAB + 2
START_OF_HUMAN, END_OF_HUMAN, START_OF_AI, END_OF_AI = TEXT_VOCAB + 3, TEXT_VOCAB + 4, TEXT_VOCAB + 5, TEXT_VOCAB + 6
AUDIO_START = TEXT_VOCAB + 10
VOCAB = AUDIO_START + 7 * CODEBOOK + 2  # 156940 for Orpheus


def config(layers: int):
    from transformers import LlamaConfig

    if args.tiny:
        return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                           tie_word_embeddings=True)
    return LlamaConfig(  # Llama-3.2-3B, as Orpheus-3B is
        vocab_size=VOCAB, hidden_size=3072, intermediate_size=8192, num_hidden_layers=layers,
        num_attention_heads=24, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True, bos_token_id=128000,
        eos_token_id=END_OF_SPEECH, pad_token_id=TEXT_VOCAB + 7,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192})


def make(path: str, layers: int) -> None:
    import torch
    from tokenizers import Tokenizer, models
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = LlamaForCausalLM(config(layers)).to(torch.bfloat16 if device == "cuda" else torch.float32)
    model.save_pretrained(path)
    # the data are token ids; from_pretrained still loads a tokenizer: a minimal word-level one
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")),
                            pad_token="<pad>", bos_token="<s>", eos_token="</s>").save_pretrained(path)


def rows(n: int, seq: int):
    """Rows as the notebook lays them out, random ids of the right kinds, exactly `seq` long."""
    import random

    rng = random.Random(1)
    out = []
    for _ in range(n):
        text = [1] + [rng.randrange(3, min(TEXT_VOCAB, 128000)) for _ in range(24)] + [END_OF_TEXT]
        head = [START_OF_HUMAN, *text, END_OF_HUMAN, START_OF_AI, START_OF_SPEECH]
        frames = (seq - len(head) - 2) // 7
        audio = [AUDIO_START + slot * CODEBOOK + rng.randrange(CODEBOOK) for _ in range(frames) for slot in range(7)]
        ids = head + audio + [END_OF_SPEECH, END_OF_AI]
        ids += [END_OF_AI] * (seq - len(ids))
        out.append({"input_ids": ids, "labels": list(ids), "attention_mask": [1] * len(ids)})
    return out


def main() -> None:
    if args.tiny:
        args.model_dir = tempfile.mkdtemp(prefix="tiny-orpheus-")
        args.seq, args.steps, args.warmup = 64, 2, 1
    if args.impl == "make" or args.tiny:
        if not os.path.exists(os.path.join(args.model_dir, "config.json")) or args.tiny:
            make(args.model_dir, args.layers)
        if args.impl == "make":
            return

    import unsloth  # noqa: F401  (first, as in the notebook)
    from unsloth import FastLanguageModel

    import torch
    from datasets import Dataset
    from transformers import Trainer, TrainerCallback, TrainingArguments

    cuda = torch.cuda.is_available()
    model, tokenizer = FastLanguageModel.from_pretrained(model_name=args.model_dir, max_seq_length=args.seq,
                                                         dtype=None, load_in_4bit=False)
    layers = model.config.num_hidden_layers
    model = FastLanguageModel.get_peft_model(
        model, r=64, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        lora_alpha=64, lora_dropout=0, bias="none", use_gradient_checkpointing="unsloth", random_state=3407,
        use_rslora=False, loftq_config=None)
    steps = args.warmup + args.steps
    dataset = Dataset.from_list(rows(args.batch * args.grad_accum * steps, args.seq))
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
                if state.global_step == args.warmup:
                    torch.cuda.reset_peak_memory_stats()
            self.start = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.start)

    from profiling import profile_step_callback  # BENCH_PROFILE=1: the last step's kernels

    trainer = Trainer(
        model=model, train_dataset=dataset, callbacks=[Timer(), profile_step_callback(steps - 1, f"tts {args.impl}")],
        args=TrainingArguments(per_device_train_batch_size=args.batch, gradient_accumulation_steps=args.grad_accum,
                               warmup_steps=1, max_steps=steps, learning_rate=2e-4, logging_steps=1,
                               optim=args.optim if cuda else "adamw_torch", weight_decay=0.001,
                               lr_scheduler_type="linear", seed=3407, output_dir=tempfile.mkdtemp(prefix="tts-"),
                               report_to="none", save_strategy="no", use_cpu=not cuda,
                               bf16=cuda and torch.cuda.is_bf16_supported(),
                               fp16=cuda and not torch.cuda.is_bf16_supported()))
    trainer.train()
    timed = times[args.warmup:]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print(json.dumps({
        "bench": "tts_orpheus", "impl": args.impl, "unsloth": os.path.dirname(unsloth.__file__),
        "shape": (f"llama-3.2-3b x{layers} layers, vocab {VOCAB}, lora r64 16-bit, b{args.batch}x{args.grad_accum} "
                  f"s{args.seq}") if not args.tiny else "tiny",
        "step_s": round(statistics.median(timed), 4), "steps": len(timed),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if cuda else None,
        "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
    }))


main()
