"""Tiny random-weight models of each family we test (hidden 64, 2 layers, vocab 300)."""

from __future__ import annotations

import contextlib
import types

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
    if family == "qwen3_5_text":  # Gated DeltaNet layers with one full-attention layer every 2
        return t.Qwen3_5TextConfig(**COMMON, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
                                   linear_num_key_heads=2, linear_num_value_heads=4,
                                   layer_types=["linear_attention", "full_attention"])
    if family == "gemma4_text":  # per-layer input embeddings, a sliding and a full layer
        return t.Gemma4TextConfig(**COMMON, head_dim=16, sliding_window=64, vocab_size_per_layer_input=VOCAB,
                                  hidden_size_per_layer_input=8, final_logit_softcapping=30.0,
                                  layer_types=["sliding_attention", "full_attention"])
    if family == "smollm3":
        return t.SmolLM3Config(**COMMON, pad_token_id=None)
    if family == "olmo2":
        return t.Olmo2Config(**COMMON)
    if family == "olmo3":  # a sliding and a full layer
        return t.Olmo3Config(**COMMON, pad_token_id=None, sliding_window=64,
                             layer_types=["sliding_attention", "full_attention"])
    if family == "phi3":  # Phi-4-mini rotates 3/4 of each head
        return t.Phi3Config(**COMMON, pad_token_id=None, partial_rotary_factor=0.75)
    if family == "granite":
        return t.GraniteConfig(**COMMON, logits_scaling=4.0, residual_multiplier=0.5, embedding_multiplier=2.0)
    if family == "granitemoehybrid":  # Granite 4 dense: no experts, attention layers with RoPE
        return t.GraniteMoeHybridConfig(**COMMON, shared_intermediate_size=128, num_local_experts=0,
                                        layer_types=["attention", "attention"], position_embedding_type="rope",
                                        residual_multiplier=0.5, embedding_multiplier=2.0, logits_scaling=4.0)
    if family == "granitemoehybrid_mamba":  # Granite 4 "h": a Mamba 2 layer and a NoPE attention layer
        return t.GraniteMoeHybridConfig(**COMMON, shared_intermediate_size=128, num_local_experts=0,
                                        num_experts_per_tok=0, layer_types=["mamba", "attention"],
                                        position_embedding_type="nope", mamba_n_heads=4, mamba_d_head=32,
                                        mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=16,
                                        residual_multiplier=0.5, embedding_multiplier=2.0, logits_scaling=4.0)
    if family == "lfm2":  # LFM2: a gated short-convolution layer and an attention layer
        return t.Lfm2Config(**COMMON, layer_types=["conv", "full_attention"], block_multiple_of=16)
    if family == "falcon_h1":  # Falcon-H1: Mamba 2 and attention side by side in every layer
        return t.FalconH1Config(**COMMON, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
                                mamba_d_state=16, mamba_chunk_size=16, mamba_expand=1)
    if family == "ernie4_5_moe":  # a dense first layer, then experts with two shared ones (as released)
        return t.Ernie4_5_MoeConfig(**COMMON, moe_intermediate_size=32, moe_k=2, moe_num_experts=4,
                                    moe_num_shared_experts=2, moe_layer_start_index=1, moe_layer_end_index=1)
    if family == "nemotron_h":  # Nemotron 3 Nano: Mamba 2, MoE and attention layers
        return t.NemotronHConfig(**{**COMMON, "num_hidden_layers": None}, head_dim=16,
                                 layers_block_type=["linear_attention", "moe", "full_attention", "moe"],
                                 mamba_num_heads=4, mamba_head_dim=32, n_groups=1, ssm_state_size=16, chunk_size=16,
                                 n_routed_experts=4, moe_intermediate_size=32, moe_shared_expert_intermediate_size=32,
                                 num_experts_per_tok=2)
    if family == "glm4":
        return t.Glm4Config(**COMMON, head_dim=16, pad_token_id=None)
    if family == "glm":
        return t.GlmConfig(**COMMON, head_dim=16, pad_token_id=None)
    if family == "ministral":
        return t.MinistralConfig(**COMMON, head_dim=16, sliding_window=64,
                                 layer_types=["sliding_attention", "full_attention"])
    if family == "ministral3":
        return t.Ministral3Config(**COMMON, head_dim=16)
    if family == "mistral3":  # Mistral 3 / Ministral 3: a Ministral 3 text model behind a Pixtral tower
        return t.Mistral3Config(text_config=t.Ministral3Config(**COMMON, head_dim=16),
                                vision_config=t.PixtralVisionConfig(hidden_size=32, intermediate_size=64,
                                                                    num_hidden_layers=1, num_attention_heads=2,
                                                                    image_size=32, patch_size=8),
                                tie_word_embeddings=False)
    if family == "gpt_oss":
        return t.GptOssConfig(**{**COMMON, "intermediate_size": 64}, head_dim=16, num_local_experts=4,
                              num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"])
    raise KeyError(family)


def has_tiny_config(family: str) -> bool:
    try:
        family_config(family)
    except KeyError:
        return False
    return True


def tiny_model(family: str, seed: int = 0, dtype=torch.float32):
    """The family's causal LM (a vision-language one, Mistral 3, as its image-text-to-text class)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    torch.manual_seed(seed)
    config = family_config(family)
    config._attn_implementation = "eager" if family in ("gemma2", "gpt_oss") else "sdpa"
    causal = type(config) in AutoModelForCausalLM._model_mapping
    model = (AutoModelForCausalLM if causal else AutoModelForImageTextToText).from_config(config).to(dtype)
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


def save_tiny(family: str, directory, model=None, **save_options):
    """A loadable folder: the tiny random model of `family` (or `model`) and a word-level tokenizer of its
    vocab; `save_options` go to save_pretrained (max_shard_size: a checkpoint of several shards)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    (model if model is not None else tiny_model(family)).save_pretrained(directory, **save_options)
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="t1", unk_token="t0").save_pretrained(directory)
    return directory


DECODER_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def decoder_linears(model) -> list[str] | str:
    """The names of the nn.Linear layers inside the decoder layers (fused qkv_proj / gate_up_proj in
    Phi-4 and GLM, input_linear / output_linear in Granite 4's MLP): the LoRA targets of a family; in a
    vision-language model, a pattern that keeps them to its language model."""
    from unsloth.models.patches import text_part

    text = text_part(model)
    layers = text.model.layers if text is model else text.layers
    names = sorted({name.rsplit(".", 1)[-1] for name, m in layers.named_modules() if isinstance(m, torch.nn.Linear)})
    if set(DECODER_TARGETS) <= set(names):  # Llama's layout (Qwen3.5's Gated DeltaNet projections left out)
        names = DECODER_TARGETS
    if text is model:
        return names
    return r".*language_model\.layers\..*\.(" + "|".join(names) + ")"


def target_names(targets: list[str] | str) -> set[str]:
    """The module names in `decoder_linears`' answer."""
    return set(targets) if isinstance(targets, list) else set(targets.rsplit("(", 1)[1].rstrip(")").split("|"))


def with_lora(model, target_modules=DECODER_TARGETS, b_std: float = 0.1):
    """peft LoRA (r=4) on `target_modules`, seeded, with B drawn non-zero (peft starts it at zero), so
    the adapters change the output and A's gradient is tested too."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                  target_modules=target_modules))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, b_std)
    return peft_model


def compile_decode_as_on_a_gpu(monkeypatch):
    """fast_generate compiles the decode step as on a GPU (shapes specialized), with dynamo's eager
    backend on the CPU."""
    from unsloth.models import generation

    gpu_config = generation._compile_config

    def as_on_a_gpu(backbone):
        config = gpu_config(types.SimpleNamespace(device=torch.device("cuda")))
        assert config is not None and config.dynamic is False
        config.backend, config.mode = "eager", None
        config._compile_all_devices = True  # transformers' own switch for compiling off a GPU
        return config

    monkeypatch.setattr(generation, "_compile_config", as_on_a_gpu)


@contextlib.contextmanager
def transformers_attention():
    """transformers' own SDPA attention for the block, where our decode attention wraps it (a reference
    run must not go through the code it checks)."""
    from transformers.modeling_utils import AttentionInterface

    mapping = AttentionInterface._global_mapping
    current = mapping["sdpa"]
    mapping["sdpa"] = getattr(current, "_unsloth_original", current)
    try:
        yield
    finally:
        mapping["sdpa"] = current
