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
    raise KeyError(family)


TESTED = ["qwen3_moe", "gpt_oss", "mixtral", "olmoe", "qwen2_moe", "deepseek_v3", "glm4_moe"]
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
        assert grad is not None and fast_grads[name] is not None, name
        torch.testing.assert_close(fast_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


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
