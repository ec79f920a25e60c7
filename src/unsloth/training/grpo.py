"""GRPO with our models: TRL's GRPOTrainer, your reward functions, our defaults.

    trainer = grpo_trainer(model, tokenizer, dataset, reward_funcs=[my_reward], max_steps=100)
    trainer.train()

A reward function is TRL's kind: `f(prompts, completions, **columns) -> list[float]`.
Completions are generated through vLLM when it is installed and the model is on a GPU (TRL's
colocate mode, sharing the GPU), else through our fast generation path (`unsloth.models.generation`:
TRL's `generate` on a static KV cache, the decode step in CUDA graphs on a GPU), which reads the
LoRA weights being trained in place: nothing is copied or merged per step. Log-probabilities of the
completions are computed chunk by chunk from the hidden states (`completion_logprobs`), never
as the full (tokens x vocab) logits; TRL releases with a fused LM head do the same in the trainer.
"""

from __future__ import annotations

from typing import Callable

import torch

from unsloth.models import generation
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


class _ChunkedLogprobs(torch.autograd.Function):
    """log p(token) per position from hidden states and the LM head, one chunk of rows at a time.

    Forward keeps no logits; backward recomputes each chunk's logits to form its gradient.
    """

    @staticmethod
    def forward(ctx, hidden, weight, tokens, chunk, temperature):
        out = torch.empty(tokens.shape, dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            logits = (hidden[start:start + chunk] @ weight.t()).float() / temperature
            picked = logits.gather(1, tokens[start:start + chunk, None]).squeeze(1)
            out[start:start + chunk] = picked - logits.logsumexp(-1)
        ctx.save_for_backward(hidden, weight, tokens)
        ctx.chunk, ctx.temperature = chunk, temperature
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, tokens = ctx.saved_tensors
        chunk, temperature = ctx.chunk, ctx.temperature
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start:start + chunk]
            logits = (h @ weight.t()).float() / temperature
            # d log p_t / d logits = onehot(t) - softmax
            d_logits = -logits.softmax(-1)
            d_logits.scatter_add_(1, tokens[start:start + chunk, None], torch.ones_like(d_logits[:, :1]))
            d_logits *= grad_out[start:start + chunk, None] / temperature
            d_logits = d_logits.to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[start:start + chunk] = d_logits @ weight
            if grad_weight is not None:
                grad_weight += (d_logits.t() @ h).float()
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None


def completion_logprobs(model, input_ids, attention_mask, logits_to_keep: int, temperature: float = 1.0,
                        chunk_tokens: int = 2048) -> torch.Tensor:
    """Log-probabilities of the last `logits_to_keep` tokens of each row, (batch, logits_to_keep),
    computed from the backbone's hidden states through the LM head in chunks of `chunk_tokens` rows."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = base.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    hidden = hidden[:, -logits_to_keep - 1:-1]  # position t predicts token t + 1
    tokens = input_ids[:, -logits_to_keep:]
    weight = base.get_output_embeddings().weight
    flat = _ChunkedLogprobs.apply(hidden.reshape(-1, hidden.shape[-1]).to(weight.dtype), weight,
                                  tokens.reshape(-1), chunk_tokens, temperature)
    return flat.view(tokens.shape)
