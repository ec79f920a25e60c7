"""MoE families through llama.cpp's converter, as a user's run ends: a tiny random MoE model -> LoRA
on attention and on the packed experts (peft target_parameters) -> merged 16-bit, in the
checkpoint's own layout -> GGUF f16 -> llama-cpp-python gives the adapted model's greedy tokens.

The slow tests use the converter the export finds (UNSLOTH_LLAMA_CPP, else the installed
llama-cpp-python's source, fetched once into the user cache)."""

from __future__ import annotations

import pytest
import torch

from export_models import GREEDY_TOKENS, MOE_PER_ARCH, TINY, family_tokenizer, greedy_agreement, make_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Shapes on top of export_models' COMMON (hidden 256, 2 layers), or its tiny MOE_PER_ARCH ones (hidden 64).
MOE = {
    "gpt_oss": {},
    "qwen3_moe": {},
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    **{arch: {} for arch in MOE_PER_ARCH},
    # Gemma 4's MoE variant: its dense config with an expert block beside the MLP of every layer
    "gemma4_text": dict(TINY, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32),
}


def moe_lora(arch: str):
    """The tiny model of `arch` with LoRA (random B, so the adapters change the output) on attention and
    on its packed experts, and the same base without adapters."""
    from peft import LoraConfig, get_peft_model

    from unsloth.models.patches.moe import expert_target_parameters

    model = make_model(arch, **MOE[arch])
    experts = expert_target_parameters(model, TARGETS)
    assert experts, f"{arch}: no packed experts to adapt"
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=TARGETS, target_parameters=experts)
    return get_peft_model(model, config).eval(), make_model(arch, **MOE[arch])


def test_mixtral_merged_save_is_in_the_published_layout(tmp_path):
    """transformers loads Mixtral's per-expert w1 / w2 / w3 into packed stacks; the merged save writes
    them back as the published checkpoints have them (what llama.cpp's converter maps), and a plain
    transformers model loads it as the adapted model."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from unsloth.export.merged import save_pretrained_merged

    model, _ = moe_lora("mixtral")
    save_pretrained_merged(model, str(tmp_path))
    names = {k for f in tmp_path.glob("*.safetensors") for k in safe_open(f, "pt").keys()}
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in names
    assert not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in names)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.randint(0, 300, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def converter():
    from unsloth.export.llama_cpp_converter import find_converter

    return find_converter()


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(MOE))
def test_moe_lora_merges_into_a_gguf_with_the_adapted_models_tokens(arch, converter, tmp_path):
    from unsloth.export import runtime
    from unsloth.export.gguf import save_pretrained_gguf
    from unsloth.export.llama_cpp_converter import hf_architecture
    from unsloth.export.validate import reference_greedy

    model, base = moe_lora(arch)
    assert hf_architecture(model.get_base_model()) in converter.architectures, f"{converter.origin} lacks {arch}"
    tokenizer = family_tokenizer(arch)
    result = save_pretrained_gguf(model, tmp_path, tokenizer, "f16")
    report = result.validations["f16"]
    assert report.passed and report.tokenizer_mismatches == [], report.summary()

    llm = runtime.load(result.files["f16"], n_ctx=128, gpu=False)
    try:
        with torch.no_grad():
            agree, total, _, runs = greedy_agreement(model, llm, tokenizer)
            differs = sum(got != reference_greedy(base, ids, GREEDY_TOKENS)[0] for ids, got in runs)
    finally:
        llm.close()
    # free-running greedy after a first (near-tie) divergence is another text: most steps must agree before it
    assert agree >= 0.75 * total, (arch, agree, total)
    assert differs, "the GGUF answers as the base model: the adapters were not merged"
