"""MoE families: patched against unpatched on tiny random models — logits, loss (with the router's
auxiliary loss) and LoRA gradients, the experts adapted through peft's target_parameters."""

from __future__ import annotations

import copy

import pytest
import torch

from tiny_families import VOCAB
from unsloth.models.patches import MOE_FAMILIES, patch_model, patch_peft_model
from unsloth.models.patches.moe import expert_target_parameters

TINY = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, max_position_embeddings=64)  # fmt: skip


def moe_config(family: str):
    import transformers as t

    if family == "qwen3_moe":
        return t.Qwen3MoeConfig(**TINY, intermediate_size=48, moe_intermediate_size=16, num_experts=6,
                                num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1)  # fmt: skip
    if family == "gpt_oss":
        return t.GptOssConfig(**TINY, intermediate_size=16, num_local_experts=6, num_experts_per_tok=2,
                              sliding_window=8, layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    if family == "mixtral":
        return t.MixtralConfig(**TINY, intermediate_size=16, num_local_experts=6, num_experts_per_tok=2)
    if family == "olmoe":
        return t.OlmoeConfig(**TINY, intermediate_size=16, num_experts=6, num_experts_per_tok=2)
    if family == "qwen2_moe":
        return t.Qwen2MoeConfig(**TINY, intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                num_experts=6, num_experts_per_tok=2)  # fmt: skip
    if family == "deepseek_v3":
        tiny = {**TINY, "num_key_value_heads": TINY["num_attention_heads"]}  # MLA: keys for every head
        return t.DeepseekV3Config(**tiny, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8,
                                  num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                                  first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                                  qk_nope_head_dim=8, v_head_dim=8)  # fmt: skip
    if family == "glm4_moe":
        return t.Glm4MoeConfig(**TINY, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8,
                               num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                               first_k_dense_replace=1)  # fmt: skip
    if family == "qwen3_5_moe_text":  # Gated DeltaNet layers and full attention, a shared expert
        return t.Qwen3_5MoeTextConfig(**TINY, intermediate_size=48, moe_intermediate_size=16, num_experts=6,
                                      num_experts_per_tok=2, shared_expert_intermediate_size=16,
                                      layer_types=["linear_attention", "full_attention"])  # fmt: skip
    if family == "gemma4_text":
        return t.Gemma4TextConfig(**TINY, intermediate_size=48, enable_moe_block=True, num_experts=6, top_k_experts=2,
                                  moe_intermediate_size=16, layer_types=["sliding_attention", "full_attention"],
                                  sliding_window=8)  # fmt: skip
    if family == "llama4_text":  # every layer MoE (top-1, as Scout), a shared expert, chunked attention
        return t.Llama4TextConfig(**TINY, intermediate_size=16, intermediate_size_mlp=48, num_local_experts=6,
                                  num_experts_per_tok=1, interleave_moe_layer_step=1, attention_chunk_size=8)  # fmt: skip
    raise KeyError(family)


TESTED = ["qwen3_moe", "gpt_oss", "mixtral", "olmoe", "qwen2_moe", "deepseek_v3", "glm4_moe", "qwen3_5_moe_text",
          "gemma4_text", "llama4_text"]
MOE_LAYERS = {"deepseek_v3": 1, "glm4_moe": 1}  # first_k_dense_replace=1: the first layer is dense


def tiny_moe(family: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = moe_config(family)
    config._attn_implementation = "eager"
    if hasattr(config, "output_router_logits"):
        config.output_router_logits = True  # the auxiliary loss joins the loss: the patch must keep it
        config.router_aux_loss_coef = 0.1
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            elif p.dim() == 3 or "bias" in name or "router" in name or ".gate." in name:
                p.normal_(0.0, 0.2)  # expert stacks, biases and routers start at zero / empty: random
    return model.eval()


def _with_lora(model):
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    torch.manual_seed(0)
    peft_model = get_peft_model(model, LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM", target_modules=targets,
        target_parameters=expert_target_parameters(model, targets)))  # fmt: skip
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    return peft_model


def _batch(seed=1, batch=2, seq=10):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    return ids, labels


def test_every_tested_family_is_registered():
    assert set(TESTED) <= set(MOE_FAMILIES)


@pytest.mark.slow
@pytest.mark.parametrize("family", TESTED)
def test_moe_patched_matches_unpatched(family):
    reference = tiny_moe(family)
    patched = copy.deepcopy(reference)
    report = patch_model(patched)
    assert report.skipped is None
    assert report.moe == MOE_LAYERS.get(family, reference.config.num_hidden_layers), report.summary()

    ids, labels = _batch()
    with torch.no_grad():
        torch.testing.assert_close(patched(input_ids=ids).logits, reference(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-4)  # fmt: skip

    reference, patched = _with_lora(reference), _with_lora(patched)
    lora = patch_peft_model(patched).lora
    assert lora["MoE experts"] == report.moe, lora
    for model in (reference, patched):
        model.train()
        model.zero_grad()
    ref_out = reference(input_ids=ids, labels=labels)
    fast_out = patched(input_ids=ids, labels=labels)
    if getattr(ref_out, "aux_loss", None) is not None:
        assert ref_out.aux_loss > 0
    torch.testing.assert_close(fast_out.loss, ref_out.loss, rtol=1e-5, atol=1e-5)
    ref_out.loss.backward()
    fast_out.loss.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    fast_grads = {n: p.grad for n, p in patched.named_parameters() if p.requires_grad}
    assert ref_grads.keys() == fast_grads.keys()
    expert_grads = [n for n in ref_grads if "experts" in n and "lora_" in n]
    assert expert_grads, "the experts carry LoRA adapters"
    for name, grad in ref_grads.items():
        if grad is None:  # a projection the family leaves unused (Gemma 4: v_proj where keys are values)
            assert fast_grads[name] is None, name
            continue
        assert fast_grads[name] is not None, name
        # fp32, sums in another order, through every layer's backward: within 1e-4 norm-wise, and element-wise
        # with a floor at 1e-4 of the tensor's largest entry for the elements that cancel to near zero
        # (Gemma 4's gradients, scaled up by its norms, need that floor)
        error = ((fast_grads[name] - grad).norm() / grad.norm()).item()
        assert error <= 1e-4, f"{name}: relative error {error:.2e}"
        torch.testing.assert_close(fast_grads[name], grad, rtol=1e-4, atol=1e-4 * grad.abs().max().item(), msg=name)


def test_moe_lora_falls_back_to_peft_when_adapters_are_disabled():
    model = tiny_moe("qwen3_moe")
    patch_model(model)
    peft_model = _with_lora(model)
    patch_peft_model(peft_model)
    ids, _ = _batch()
    with torch.no_grad():
        adapted = peft_model(input_ids=ids).logits
        with peft_model.disable_adapter():
            plain = peft_model(input_ids=ids).logits
        base = copy.deepcopy(tiny_moe("qwen3_moe"))(input_ids=ids).logits
    torch.testing.assert_close(plain, base, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(adapted, plain, atol=1e-3)


def test_expert_targets_follow_the_notebooks_target_modules():
    model = tiny_moe("qwen3_moe")
    assert expert_target_parameters(model, ["q_proj", "down_proj"]) == ["experts.down_proj"]
    assert expert_target_parameters(model, ["gate_proj", "up_proj", "down_proj"]) == [
        "experts.gate_up_proj", "experts.down_proj"]
    assert expert_target_parameters(model, ["q_proj", "v_proj"]) == []


@pytest.mark.slow
def test_mxfp4_gpt_oss_checkpoint_loads_dequantized(tmp_path):
    """A gpt-oss checkpoint published in MXFP4 (expert stacks as `_blocks` / `_scales`) loads with
    its experts dequantized by transformers' own path, and our experts patch takes them."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from unsloth.models.loader import _published_quantization, checkpoint_quant_method

    import transformers as t

    config = t.GptOssConfig(**{**TINY, "hidden_size": 64}, intermediate_size=32, num_local_experts=4,
                            num_experts_per_tok=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path)
    (weights_file,) = tmp_path.glob("*.safetensors")
    tensors = load_file(weights_file)
    g = torch.Generator().manual_seed(0)
    expected = {}
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inp, out = tensors.pop(key).shape  # stored (E, out, in / 32, 16) nibbles and (E, out, in / 32) exponents
        blocks = torch.randint(0, 256, (experts, out, inp // 32, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(122, 130, (experts, out, inp // 32), generator=g, dtype=torch.uint8)
        tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = blocks, scales
        expected[key] = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    save_file(tensors, weights_file, metadata={"format": "pt"})
    config_file = tmp_path / "config.json"
    saved = json.loads(config_file.read_text())
    saved["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "lm_head", "embed"]}
    config_file.write_text(json.dumps(saved))

    assert checkpoint_quant_method(str(tmp_path)) == "mxfp4"
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.bfloat16, quantization_config=_published_quantization(str(tmp_path), torch.bfloat16))
    params = dict(model.named_parameters())
    for key, dense in expected.items():
        assert params[key].dtype == torch.bfloat16 and torch.equal(params[key].data, dense), key
    assert patch_model(model.float()).moe == 2
