"""The built-in demo: teach a tiny model, built here, the capitals of 50 countries.

Runs anywhere, CPU included, in about two minutes: a byte-level BPE tokenizer trained on the
shipped task data, a small Llama-architecture model with random weights, LoRA fine-tuning through
the same path as `unsloth train CONFIG`, then a few questions answered by the trained model. The
merged model and tokenizer are saved as an ordinary transformers folder (llama.cpp can convert it).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from unsloth.training.config import DatasetConfig, LoraSettings, ModelConfig, TrainConfig

DATA = "capitals.jsonl"
DEFAULT_OUTPUT = "unsloth-demo"
SPECIAL = {"bos": "<|begin_of_text|>", "eos": "<|end_of_text|>", "pad": "<|pad|>"}
ROLES = ("system", "user", "assistant")
# One header token per role, then the text, then eos: simple for llama.cpp's template engine too.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}{{ message['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def data_path() -> Path:
    return Path(str(resources.files("unsloth.training") / "data" / DATA))


def _rows() -> list[dict]:
    return [json.loads(line) for line in data_path().read_text().splitlines() if line.strip()]


def load_examples() -> list[tuple[str, str]]:
    """(question, answer) pairs of the shipped task."""
    return [(r["prompt"][-1]["content"], r["completion"][-1]["content"]) for r in _rows()]


def with_history(rows: list[dict], seed: int = 0) -> list[dict]:
    """Each example again, after one to four other questions already answered. A chat sends the whole
    conversation each turn (`unsloth chat`, llama.cpp); trained on single questions only, the model
    answers a later turn from the first one ("Peru?" -> "Berlin")."""
    rng = random.Random(seed)
    out = []
    for row in rows:
        earlier = rng.sample([r for r in rows if r is not row], rng.randint(1, 4))
        history = [message for r in earlier for message in (*r["prompt"], *r["completion"])]
        out.append({"prompt": history + row["prompt"], "completion": row["completion"]})
    return out


def write_training_data(directory: Path) -> Path:
    """The shipped questions, alone and inside conversations, as one .jsonl under ``directory``."""
    rows = _rows()
    path = directory / "train.jsonl"
    directory.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows + with_history(rows)), encoding="utf-8")
    return path


def build_tokenizer(texts: list[str], vocab_size: int = 512):
    """A GPT-2 style byte-level BPE trained on `texts`, with the chat template; llama.cpp reads it as "gpt2"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = list(SPECIAL.values()) + [f"<|{role}|>" for role in ROLES]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SPECIAL["bos"], eos_token=SPECIAL["eos"], pad_token=SPECIAL["pad"],
        chat_template=CHAT_TEMPLATE, padding_side="right",
    )


def build_base_model(directory: str | os.PathLike, seed: int = 0) -> str:
    """Write a small random-weight Llama model and its tokenizer to `directory`; returns the path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    examples = load_examples()
    tokenizer = build_tokenizer([f"{q} {a}" for q, a in examples])
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=344, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # At the usual init (std 0.02) a frozen head caps the logits near +-3: LoRA could rank the right
        # answer first but never make it confident. A wider head lets the loss fall the way it would
        # on a pretrained model.
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def demo_config(output_dir: str = DEFAULT_OUTPUT, max_steps: int = 150, data: Path | None = None) -> TrainConfig:
    """The demo as an ordinary training config (the base model path and the data are filled in by `run_demo`)."""
    return TrainConfig(
        model=ModelConfig(name="", max_seq_length=128, load_in_4bit=False, dtype="float32"),
        dataset=DatasetConfig(name=str(data or data_path())),
        lora=LoraSettings(r=32, alpha=64, dropout=0.0),
        output_dir=output_dir,
        save_merged=True,
        gradient_checkpointing=False,
        training={
            "max_steps": max_steps, "per_device_train_batch_size": 16, "gradient_accumulation_steps": 1,
            "learning_rate": 3e-3, "lr_scheduler_type": "cosine", "warmup_steps": 10,
            # At least one logged loss however short the run (the demo reports first -> last).
            "logging_steps": max(1, min(10, max_steps // 10)),
            "save_strategy": "no", "seed": 0, "weight_decay": 0.0,
        },
    )


@dataclass
class DemoResult:
    losses: list[float]
    answers: list[tuple[str, str, str]]  # (question, expected, model's answer)
    merged_dir: str

    @property
    def correct(self) -> int:
        return sum(expected == got for _, expected, got in self.answers)


def ask(model, tokenizer, questions: list[str], max_new_tokens: int = 12) -> list[str]:
    """Greedy answers of a chat model to single-turn questions."""
    import torch

    answers = []
    for question in questions:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        ids = ids.to(next(model.parameters()).device)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)
        answers.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip())
    return answers


def run_demo(output_dir: str = DEFAULT_OUTPUT, max_steps: int = 150, show: int = 6, echo=print) -> DemoResult:
    """Build, train, check and save the demo model; returns the loss log and a few answers."""
    import torch

    from unsloth.models.loader import model_config
    from unsloth.training.sft import train

    if not torch.cuda.is_available():
        # Matrices this small gain nothing from more threads, and on a busy machine extra OpenMP
        # threads spin against other work: one thread is several times faster here.
        torch.set_num_threads(1)
    output = Path(output_dir)
    base_dir = build_base_model(output / "base")
    config = demo_config(str(output), max_steps, write_training_data(output / "data"))
    config.model.name = base_dir
    echo(f"unsloth demo: a {_describe(base_dir)} learns the capitals of 50 countries ({max_steps} steps)")
    result = train(config, echo=echo)
    result.model.eval()
    model_config(result.model).use_cache = True  # for generate
    countries = load_examples()[::3]  # one phrasing per country
    examples = countries[:: max(1, len(countries) // max(show, 1))][:show]
    got = ask(result.model, result.tokenizer, [q for q, _ in examples])
    answers = [(q, a, g) for (q, a), g in zip(examples, got)]
    demo = DemoResult(result.losses, answers, result.merged_dir)
    for question, expected, answer in answers:
        mark = "ok " if answer == expected else "MISS"
        echo(f"  [{mark}] {question} -> {answer}")
    echo(f"loss {demo.losses[0]:.2f} -> {demo.losses[-1]:.2f}; {demo.correct}/{len(answers)} answers right; "
         f"merged model + tokenizer saved to {demo.merged_dir}")
    return demo


def demos() -> dict:
    """The built-in demos by name (`unsloth train --demo NAME`): each takes output_dir and max_steps and
    returns a result whose `losses` fell if it learnt."""
    return {"capitals": run_demo}


def _describe(base_dir: str) -> str:
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(base_dir)
    return f"{c.num_hidden_layers}-layer Llama (hidden {c.hidden_size}, vocab {c.vocab_size}, random weights)"
