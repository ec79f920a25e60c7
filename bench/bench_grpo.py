"""A GRPO step in the notebooks' style (Llama-3.1-8B shapes, QLoRA by default, one prompt of 256 tokens
and a group of 8 completions of 256 tokens, adamw_8bit, no vLLM): ours or the public Unsloth,
whichever `import unsloth` finds first on PYTHONPATH.

The cells are the GRPO notebooks': FastLanguageModel.from_pretrained -> get_peft_model(r=16, the seven
projections, use_gradient_checkpointing="unsloth") -> GRPOTrainer(model=, processing_class=,
reward_funcs=, args=GRPOConfig(...)) -> trainer.train(). The weights are random (the anchors'
/tmp/llama8b, written by `.anchors/anchor_lora.py --impl make`); prompts are random words of a
word-level tokenizer written beside them (one token each), and `min_new_tokens` makes every
completion its full length, so both impls generate and train on the same amount.

JSON lines: {"event": "loaded"} once the model is ready; {"event": "step"} per optimizer step (its
time, the peak memory so far, the reward and loss TRL logged, and what the step's `generate` calls
returned: `generate_calls`, `rows` and `generated_tokens`, the new positions of every row, prompt
excluded, so that both implementations visibly decode the same amount, and `rollouts_sha`, a digest
of those new tokens: two runs with the same seed print the same digests, and so do two
implementations whose rollouts are equal token for token; `generate_s`, the seconds spent inside them,
the GPU drained before and after each); then {"event": "summary"}:
the median step time after the warm-up steps (rollouts + scoring + the update), the peak over the
timed steps, every step's reward, loss and generated tokens. Killed by SIGTERM (h200.sh's `timeout`), it
prints the summary of the steps it finished, with "partial": true, before it exits.

    ROOT=$PWD
    python3 .anchors/anchor_lora.py --impl make >/dev/null
    PYTHONPATH=/tmp/site:$ROOT/src:$ROOT/kernels:$ROOT/.anchors/site python3 bench/bench_grpo.py --impl ours
    PYTHONPATH=/tmp/site:$ROOT/.anchors/site python3 bench/bench_grpo.py --impl unsloth
    python3 bench/bench_grpo.py --tiny  # the code path on a CPU, a tiny seeded random Llama: two runs, same numbers
`--sync-every-step` (ours): rollouts wait for every decode step, as before the deferred stop check.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time

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
p.add_argument("--sync-every-step", action="store_true",
               help="ours: rollouts wait for every decode step, as transformers does on CUDA (A/B of the deferred "
                    "stop check)")
p.add_argument("--nf4-tuning", metavar="FILE",
               help="ours: nf4_matmul's launch configurations from bench/nf4_matmul.py --tuning-out (same call)")
args = p.parse_args()

import unsloth  # noqa: E402  (first, as in the notebooks)
from unsloth import FastLanguageModel  # noqa: E402

if args.nf4_tuning and args.impl == "ours":
    from bench_generation import use_nf4_tuning  # this folder: a script's own folder is on its path

    use_nf4_tuning(args.nf4_tuning)

if args.sync_every_step and args.impl == "ours":
    from unsloth.models import generation

    generation.DEFER_DEVICES = set()

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
    # seeded: GRPOConfig's seed reaches only what runs after the trainer is built, not these random weights
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlamaForCausalLM(cfg).save_pretrained(path)


def emit(**fields) -> None:
    print(json.dumps({"bench": "grpo", "impl": args.impl, **fields}), flush=True)


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def peak_gib():
    return round(torch.cuda.max_memory_allocated() / 2**30, 3) if CUDA else None


class Run:
    """What the steps measured so far; `summary` is the last JSON line, complete or (killed) partial."""

    def __init__(self, shape: str):
        self.shape, self.times, self.logs, self.generated = shape, [], [], []

    def summary(self, partial: bool = False) -> None:
        timed = self.times[args.warmup:]
        last = self.logs[-1] if self.logs else {}
        emit(event="summary", partial=partial, unsloth=os.path.dirname(unsloth.__file__), shape=self.shape,
             sync_every_step=args.sync_every_step,
             nf4_sum_in_graph=os.environ.get("UNSLOTH_NF4_SUM_IN_GRAPH", "1") != "0",
             nf4_unroll_rank=int(os.environ.get("UNSLOTH_NF4_UNROLL_RANK", "16")),
             step_s=round(statistics.median(timed), 3) if timed else None, steps=len(timed),
             first_step_s=round(self.times[0], 2) if self.times else None,
             peak_gib=peak_gib() if timed else None,  # the counter restarts when the timed steps begin
             completion_length=last.get("completions/mean_length"),
             rewards=[log.get("reward") for log in self.logs], losses=[log.get("loss") for log in self.logs],
             reward=last.get("reward"), loss=last.get("loss"),
             generated_tokens=[g["generated_tokens"] for g in self.generated],
             generate_calls=[g["generate_calls"] for g in self.generated],
             rollouts_sha=[g["rollouts_sha"] for g in self.generated],
             generate_s=[g["generate_s"] for g in self.generated])


class GenerateCounter:
    """Counts what the trainer's `generate` calls return. Put on the model TRL unwraps for its rollouts
    (the PEFT model), under whatever each implementation installs there during a rollout."""

    def __init__(self):
        self.calls = self.rows = self.tokens = 0
        self.seconds = 0.0
        self.digest = hashlib.sha256()

    def wrap(self, model) -> None:
        inner = model.generate

        def generate(*args, **kwargs):
            sync()
            start = time.perf_counter()
            out = inner(*args, **kwargs)
            sync()
            self.seconds += time.perf_counter() - start
            prompt = kwargs.get("input_ids", args[0] if args else None)
            sequences = out if torch.is_tensor(out) else out.sequences
            self.calls += 1
            self.rows += sequences.shape[0]
            self.tokens += sequences.shape[0] * (sequences.shape[1] - prompt.shape[1])
            self.digest.update(sequences[:, prompt.shape[1]:].cpu().numpy().tobytes())
            return out

        model.generate = generate

    def take(self) -> dict:
        counts = {"generate_calls": self.calls, "rows": self.rows, "generated_tokens": self.tokens,
                  "rollouts_sha": self.digest.hexdigest()[:16], "generate_s": round(self.seconds, 3)}
        self.calls = self.rows = self.tokens = 0
        self.seconds = 0.0
        self.digest = hashlib.sha256()
        return counts


def step_lines(run: Run, counter: GenerateCounter):
    """A Trainer callback printing one JSON line per logged step (logging_steps=1: every step)."""
    from bench_generation import dynamo_counts  # this folder: a script's own folder is on its path
    from transformers import TrainerCallback

    class StepLines(TrainerCallback):
        def on_log(self, args_, state, control, logs=None, **kwargs):
            if not logs or "reward" not in logs:
                return
            run.logs.append(dict(logs))
            run.generated.append(counter.take())  # this step's rollouts
            emit(event="step", step=state.global_step, warmup=state.global_step <= args.warmup,
                 step_s=round(run.times[-1], 3) if run.times else None, peak_gib=peak_gib(),
                 reward=logs.get("reward"), reward_std=logs.get("reward_std"), loss=logs.get("loss"),
                 completion_length=logs.get("completions/mean_length"), **run.generated[-1], **dynamo_counts())

    return StepLines()


def main() -> None:
    from datasets import Dataset
    from profiling import step_timer
    from trl import GRPOConfig, GRPOTrainer

    words = WORDS
    if args.tiny:
        args.model_dir = tempfile.mkdtemp(prefix="tiny-llama-")
        make_tiny(args.model_dir)
        args.prompt, args.completion, args.generations = 12, 6, 4
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
        args.optim, words = "adamw_torch", 512
    run = Run("tiny" if args.tiny else f"{'bf16' if args.bf16 else 'qlora'} p{args.prompt} "
                                       f"g{args.generations}x{args.completion}")

    def killed(signum, frame):  # h200.sh's `timeout`: say what was measured, then go
        run.summary(partial=True)
        sys.stdout.flush()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, killed)
    folder = model_folder(args.model_dir, words)
    seq = args.prompt + args.completion
    start = time.perf_counter()
    model, tokenizer = FastLanguageModel.from_pretrained(model_name=folder, max_seq_length=seq, dtype=None,
                                                         load_in_4bit=not (args.bf16 or args.tiny))
    model = FastLanguageModel.get_peft_model(
        model, r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        lora_alpha=16, lora_dropout=0, bias="none", use_gradient_checkpointing="unsloth", random_state=3407)
    emit(event="loaded", load_s=round(time.perf_counter() - start, 1), peak_gib=peak_gib())
    steps = args.warmup + args.steps
    generator = torch.Generator().manual_seed(1)
    prompts = [" ".join(f"w{i}" for i in torch.randint(3, words, (args.prompt,), generator=generator).tolist())
               for _ in range(steps)]
    dataset = Dataset.from_dict({"prompt": prompts})

    def even_words(completions, **_):  # a reward that varies within a group, so the advantages are not all zero
        return [float(sum(w[-1:] in "02468" for w in c.split())) for c in completions]

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="grpo-"), learning_rate=5e-6, optim=args.optim, logging_steps=1,
        per_device_train_batch_size=args.generations, gradient_accumulation_steps=1,
        num_generations=args.generations, max_completion_length=args.completion, max_steps=steps,
        generation_kwargs={"min_new_tokens": args.completion}, use_vllm=False, report_to="none",
        save_strategy="no", seed=3407, shuffle_dataset=False, max_grad_norm=0.1,
        disable_tqdm=True,  # its bar shares stderr with the JSON lines: h200.sh keeps only lines starting with {
        bf16=CUDA and torch.cuda.is_bf16_supported(), fp16=CUDA and not torch.cuda.is_bf16_supported())
    counter = GenerateCounter()
    # the timer first: a step's line reads its time
    callbacks = [step_timer(run.times, args.warmup), step_lines(run, counter)]
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[even_words], args=config,
                          train_dataset=dataset, callbacks=callbacks)
    counter.wrap(trainer.model)  # after the trainer is built: what TRL's rollouts call
    trainer.train()
    run.summary()


main()
