"""A GRPO step in the notebooks' style (Llama-3.1-8B shapes, QLoRA by default, one prompt of 256 tokens
and a group of 8 completions of 256 tokens, adamw_8bit, no vLLM): ours or the public Unsloth,
whichever `import unsloth` finds first on PYTHONPATH.

The cells are the GRPO notebooks': FastLanguageModel.from_pretrained -> get_peft_model(r=16, the seven
projections, use_gradient_checkpointing="unsloth") -> GRPOTrainer(model=, processing_class=,
reward_funcs=, args=GRPOConfig(...)) -> trainer.train(). The weights are random (the anchors'
/tmp/llama8b, written by `.anchors/anchor_lora.py --impl make`); prompts are random words of a
word-level tokenizer written beside them (one token each), and `min_new_tokens` makes every
completion its full length, so both impls generate and train on the same amount. One JSON line:
median step time after the warm-up steps (rollouts + scoring + the update), and peak memory.

    ROOT=$PWD
    python3 .anchors/anchor_lora.py --impl make >/dev/null
    PYTHONPATH=/tmp/site:$ROOT/src:$ROOT/kernels:$ROOT/.anchors/site python3 bench/bench_grpo.py --impl ours
    PYTHONPATH=/tmp/site:$ROOT/.anchors/site python3 bench/bench_grpo.py --impl unsloth
    python3 bench/bench_grpo.py --tiny      # the code path on a CPU, a tiny random Llama
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
p.add_argument("--prompt", type=int, default=256)
p.add_argument("--completion", type=int, default=256)
p.add_argument("--generations", type=int, default=8)
p.add_argument("--steps", type=int, default=2)
p.add_argument("--warmup", type=int, default=1, help="untimed steps first (compiles, captures)")
p.add_argument("--bf16", action="store_true", help="16-bit weights instead of 4-bit (QLoRA)")
p.add_argument("--optim", default="adamw_8bit")
p.add_argument("--tiny", action="store_true", help="a tiny random Llama on the CPU: checks the code path only")
args = p.parse_args()

import unsloth  # noqa: E402  (first, as in the notebooks)
from unsloth import FastLanguageModel  # noqa: E402

import torch  # noqa: E402

CUDA = torch.cuda.is_available()
WORDS = 32000  # the tokenizer's vocabulary: one token per word, all inside the model's


def model_folder(weights_dir: str, words: int) -> str:
    """The weights (linked, not copied) beside a word-level tokenizer, in a folder of their own."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = tempfile.mkdtemp(prefix="grpo-model-")
    for name in os.listdir(weights_dir):
        if name.endswith((".safetensors", ".json")) and "tokenizer" not in name and name != "special_tokens_map.json":
            os.symlink(os.path.join(weights_dir, name), os.path.join(folder, name))
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(folder)
    return folder


def make_tiny(path: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    LlamaForCausalLM(cfg).save_pretrained(path)


def main() -> None:
    from datasets import Dataset
    from profiling import step_timer
    from trl import GRPOConfig, GRPOTrainer

    words = WORDS
    if args.tiny:
        args.model_dir = tempfile.mkdtemp(prefix="tiny-llama-")
        make_tiny(args.model_dir)
        args.prompt, args.completion, args.generations, args.steps, args.warmup = 12, 6, 4, 1, 1
        args.optim, words = "adamw_torch", 512
    folder = model_folder(args.model_dir, words)
    seq = args.prompt + args.completion
    model, tokenizer = FastLanguageModel.from_pretrained(model_name=folder, max_seq_length=seq, dtype=None,
                                                         load_in_4bit=not (args.bf16 or args.tiny))
    model = FastLanguageModel.get_peft_model(
        model, r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        lora_alpha=16, lora_dropout=0, bias="none", use_gradient_checkpointing="unsloth", random_state=3407)
    steps = args.warmup + args.steps
    generator = torch.Generator().manual_seed(1)
    prompts = [" ".join(f"w{i}" for i in torch.randint(3, words, (args.prompt,), generator=generator).tolist())
               for _ in range(steps)]
    dataset = Dataset.from_dict({"prompt": prompts})

    def even_words(completions, **_):  # a reward that varies within a group, so the advantages are not all zero
        return [float(sum(w[-1:] in "02468" for w in c.split())) for c in completions]

    times: list[float] = []

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="grpo-"), learning_rate=5e-6, optim=args.optim, logging_steps=1,
        per_device_train_batch_size=args.generations, gradient_accumulation_steps=1,
        num_generations=args.generations, max_completion_length=args.completion, max_steps=steps,
        generation_kwargs={"min_new_tokens": args.completion}, use_vllm=False, report_to="none",
        save_strategy="no", seed=3407, shuffle_dataset=False, max_grad_norm=0.1,
        bf16=CUDA and torch.cuda.is_bf16_supported(), fp16=CUDA and not torch.cuda.is_bf16_supported())
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[even_words], args=config,
                          train_dataset=dataset, callbacks=[step_timer(times, args.warmup)])
    trainer.train()
    timed = times[args.warmup:]
    logs = [h for h in trainer.state.log_history if "reward" in h]
    print(json.dumps({
        "bench": "grpo", "impl": args.impl, "unsloth": os.path.dirname(unsloth.__file__),
        "shape": "tiny" if args.tiny else f"{'bf16' if args.bf16 else 'qlora'} p{args.prompt} "
                                          f"g{args.generations}x{args.completion}",
        "step_s": round(statistics.median(timed), 3), "steps": len(timed), "first_step_s": round(times[0], 2),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if CUDA else None,
        "completion_length": logs[-1].get("completions/mean_length") if logs else None,
        "reward": logs[-1].get("reward") if logs else None, "loss": logs[-1].get("loss") if logs else None,
    }), flush=True)


main()
