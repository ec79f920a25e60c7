"""GRPO with our models: TRL's GRPOTrainer, your reward functions, our defaults.

    trainer = grpo_trainer(model, tokenizer, dataset, reward_funcs=[my_reward], max_steps=100)
    trainer.train()

A reward function is TRL's kind: `f(prompts, completions, **columns) -> list[float]`.
Completions are generated through vLLM when it is installed and the model is on a GPU (TRL's
colocate mode, sharing the GPU), else through our fast generation path (`unsloth.models.generation`:
TRL's `generate` on a static KV cache, the decode step in CUDA graphs on a GPU), which reads the
LoRA weights being trained in place: nothing is copied or merged per step. In the trainer, TRL
(1.16) scores the completions through its own fused LM head, in tiles, never the full (tokens x vocab)
logits; `completion_logprobs` gives the same log-probabilities from the hidden states through our
fused log-prob kernel (`unsloth_kernels.log_probs`, as preference training uses), for code outside it.
"""

from __future__ import annotations

from typing import Callable

import torch

from unsloth.models import generation
from unsloth.models.kernels import unavailable_reason
from unsloth.models.loader import vllm_usable


def grpo_trainer(model, tokenizer, dataset, reward_funcs: list[Callable] | Callable, callbacks=(), **arguments):
    """A TRL GRPOTrainer for a FastLanguageModel; `arguments` are GRPOConfig fields over our defaults."""
    from trl import GRPOConfig, GRPOTrainer

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    defaults = {
        "output_dir": "outputs-grpo",
        "learning_rate": 5e-6,
        "logging_steps": 1,
        "report_to": "none",
        "use_vllm": vllm_usable(model),
        # Our per-layer (offloaded) checkpointing is already on; the Trainer's would recompute twice.
        "gradient_checkpointing": False,
        "bf16": base.dtype == torch.bfloat16,
        "fp16": base.dtype == torch.float16,
    }
    config = GRPOConfig(**{**defaults, **arguments})
    if not config.use_vllm:
        generation.enable(model)  # TRL's rollouts call model.generate: through the fast path
    return GRPOTrainer(model=model, reward_funcs=reward_funcs, args=config, train_dataset=dataset,
                       processing_class=tokenizer, callbacks=list(callbacks))


def completion_logprobs(model, input_ids, attention_mask, logits_to_keep: int, temperature: float = 1.0,
                        chunk_tokens: int = 2048) -> torch.Tensor:
    """Log-probabilities of the last `logits_to_keep` tokens of each row, (batch, logits_to_keep),
    computed from the backbone's hidden states through the LM head in chunks of `chunk_tokens` rows."""
    from unsloth_kernels.log_probs import fused_linear_log_probs

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = base.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    hidden = hidden[:, -logits_to_keep - 1:-1]  # position t predicts token t + 1
    tokens = input_ids[:, -logits_to_keep:]
    weight = base.get_output_embeddings().weight
    logp, _, _, _ = fused_linear_log_probs(hidden.reshape(-1, hidden.shape[-1]), weight, tokens.reshape(-1),
                                           logit_scale=None if temperature == 1.0 else 1.0 / temperature,
                                           chunk_size=chunk_tokens, use_triton=unavailable_reason(weight.device) is None)
    return logp.view(tokens.shape)
