"""Tiny random-weight models of each patched family (hidden 64, 2 layers, vocab 300)."""

from __future__ import annotations

import torch

VOCAB = 300
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def family_config(family: str):
    import transformers as t

    if family == "llama":
        return t.LlamaConfig(**COMMON)
    if family == "mistral":
        return t.MistralConfig(**COMMON, sliding_window=None)
    if family == "qwen2":
        return t.Qwen2Config(**COMMON)
    if family == "qwen3":
        return t.Qwen3Config(**COMMON, head_dim=16)
    if family == "gemma":
        return t.GemmaConfig(**COMMON, head_dim=16, hidden_act="gelu_pytorch_tanh")
    if family == "gemma2":
        return t.Gemma2Config(**COMMON, head_dim=16, final_logit_softcapping=30.0,
                              attn_logit_softcapping=50.0, sliding_window=64)
    if family == "gemma3_text":
        return t.Gemma3TextConfig(**COMMON, head_dim=16, sliding_window=64)
    if family == "phi":
        return t.PhiConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4)
    raise KeyError(family)


def tiny_model(family: str, seed: int = 0, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = family_config(family)
    config._attn_implementation = "eager" if family == "gemma2" else "sdpa"
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    with torch.no_grad():  # random norm weights, so a wrong (1 + w) convention cannot hide
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    return model.eval()


def tiny_llama():
    """An in-memory random Llama (no tokenizer) for tests that feed token ids directly."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(config).eval()
