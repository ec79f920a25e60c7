"""A tiny Llama folder (hidden 64, 2 layers, byte-level BPE of ~300 tokens) and a small chat dataset."""

from __future__ import annotations

import json
from pathlib import Path

from unsloth.training.demo import build_tokenizer, load_examples

VOCAB = 300


def write_tiny_model(directory: Path) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    examples = load_examples()
    tokenizer = build_tokenizer([f"{q} {a}" for q, a in examples], vocab_size=300)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def write_dataset(path: Path, rows: int = 24) -> str:
    with open(path, "w") as f:
        for question, answer in load_examples()[:rows]:
            f.write(json.dumps({"messages": [{"role": "user", "content": question},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    return str(path)
