"""The host's share of a host-paced LoRA step, measured on a CPU: the TTS bench's step (14 Llama
layers, LoRA r=64 on all seven projections, batch 1 x grad-accum 4, our checkpointing) at a tiny
width, with every Triton launch stubbed out once the model is patched. What is left is the Python
and dispatch work a GPU step's host does, plus tiny CPU matmuls. No GPU needed; compare two source
trees by running each in turn (the machine's noise is a few percent: alternate, and take medians).

    TRITON_INTERPRET=1 PYTHONPATH=src:kernels python3 bench/host_proxy.py [--profile]

One JSON line: CPU time per optimizer step (time.process_time), min and median after two warm-up
steps; --profile adds cProfile's top functions for one step (by own time) on stderr.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import tempfile
import time

p = argparse.ArgumentParser()
p.add_argument("--layers", type=int, default=14)
p.add_argument("--steps", type=int, default=16)
p.add_argument("--profile", action="store_true")
args = p.parse_args()

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models  # noqa: E402
from transformers import (LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Trainer,  # noqa: E402
                          TrainerCallback, TrainingArguments)

from unsloth import FastLanguageModel  # noqa: E402

torch.set_num_threads(1)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_model(path: str) -> None:
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=args.layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(path)
    words = Tokenizer(models.WordLevel({"<pad>": 0, "<s>": 1, "</s>": 2}, unk_token="<pad>"))
    PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)


def stub_kernel_launches() -> None:
    """Every interpreted Triton launch does nothing from now on (the model's probes ran for real)."""
    from triton.runtime import interpreter

    interpreter.InterpretedFunction.run = lambda self, *a, **k: None
    interpreter.InterpretedFunction.__getitem__ = lambda self, grid: (lambda *a, **k: None)


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 (the kernels' launches are stubbed through the interpreter)")
    folder = tempfile.mkdtemp(prefix="host-proxy-")
    tiny_model(folder)
    model, _ = FastLanguageModel.from_pretrained(folder, max_seq_length=64, dtype=torch.float32, load_in_4bit=False)
    model = FastLanguageModel.get_peft_model(model, r=64, lora_alpha=64, target_modules=TARGETS,
                                             use_gradient_checkpointing="unsloth")
    stub_kernel_launches()
    row = {"input_ids": list(range(3, 67)), "labels": list(range(3, 67)), "attention_mask": [1] * 64}
    times: list[float] = []
    profiler = cProfile.Profile()
    profiled = args.steps - 2

    class Clock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            if args.profile and state.global_step == profiled:
                profiler.enable()
            self.start = time.process_time()

        def on_step_end(self, a, state, control, **kw):
            times.append(time.process_time() - self.start)
            if args.profile and state.global_step == profiled + 1:
                profiler.disable()

    Trainer(model=model, train_dataset=Dataset.from_list([row] * (4 * args.steps)), callbacks=[Clock()],
            args=TrainingArguments(per_device_train_batch_size=1, gradient_accumulation_steps=4,
                                   max_steps=args.steps, learning_rate=2e-4, optim="adamw_torch",
                                   output_dir=folder + "/out", report_to="none", save_strategy="no",
                                   use_cpu=True, disable_tqdm=True, logging_steps=args.steps)).train()
    timed = [t * 1e3 for t in times[2:]]
    print(json.dumps({"bench": "host_proxy", "layers": args.layers, "steps": len(timed),
                      "min_ms": round(min(timed), 1), "median_ms": round(statistics.median(timed), 1)}))
    if args.profile:
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
