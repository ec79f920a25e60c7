"""QLoRA of packed MoE experts: the expert stacks quantized to NF4 on load, read by our kernel.

The reference is the same model with each stack replaced by its dequantized dense values, so the
two compute with identical weights: outputs, loss and LoRA gradients must agree to fp32 rounding.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from test_models_moe import _batch, _with_lora, tiny_moe
from unsloth.models.patches import patch_model, patch_peft_model

pytest.importorskip("bitsandbytes")

from unsloth.models.experts_4bit import (  # noqa: E402
    Nf4Stack,
    dequantize_packed_experts,
    expert_stack_bytes,
    quantize_packed_experts,
)


def _quantized_pair(family):
    """(4-bit model, dense reference holding the 4-bit model's dequantized stacks), both patched."""
    model = tiny_moe(family)
    patch_model(model)
    model.requires_grad_(False)
    assert quantize_packed_experts(model) == 2 * model.config.num_hidden_layers
    reference = copy.deepcopy(model)
    assert dequantize_packed_experts(reference) == 2 * model.config.num_hidden_layers
    return model, reference


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "llama4_text"])
def test_4bit_experts_match_their_dequantized_reference(family):
    model, reference = _quantized_pair(family)
    stacks = [m.gate_up_proj for m in model.modules() if "_unsloth_moe" in m.__dict__]
    assert stacks and all(isinstance(s, Nf4Stack) for s in stacks)
    ids, labels = _batch()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=1e-4, atol=1e-4)

    model, reference = _with_lora(model), _with_lora(reference)
    assert patch_peft_model(model).lora["MoE experts"] == model.config.num_hidden_layers
    patch_peft_model(reference)
    losses = []
    for m in (model, reference):
        m.train()
        out = m(input_ids=ids, labels=labels)
        out.loss.backward()
        losses.append(out.loss)
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    assert grads.keys() == ref_grads.keys()
    assert any("experts" in n and "lora_A" in n for n in grads), "the experts carry LoRA adapters"
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-4 * grad.abs().max().item(), msg=name)


@pytest.mark.slow
def test_4bit_stacks_hold_about_a_quarter_of_the_bf16_bytes():
    import transformers as t

    # stacks of 64 K weights: large enough that the codes' fixed 1 KiB per stack is small beside them
    config = t.Qwen3MoeConfig(vocab_size=64, hidden_size=128, intermediate_size=64, moe_intermediate_size=64,
                              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                              num_experts=8, num_experts_per_tok=2)  # fmt: skip
    model = t.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    patch_model(model)
    model.requires_grad_(False)
    dense = expert_stack_bytes(model)
    assert dense == sum(p.numel() * 2 for n, p in model.named_parameters() if n.endswith(("gate_up_proj", "down_proj")))
    quantize_packed_experts(model)
    quantized = expert_stack_bytes(model)
    # 4 bits a weight + one uint8 scale per 64 + the nested level's fp32 scales and the two codes
    assert 3.5 < dense / quantized < 4.0, (dense, quantized)
    assert all(p.packed.dtype == torch.uint8 for p in model.parameters() if isinstance(p, Nf4Stack))


@pytest.mark.slow
def test_stock_forward_over_a_4bit_stack_sees_the_dequantized_weights():
    """Anything not our kernel (the module's own forward, peft's fallback, exports) reads dequantized weights."""
    model, reference = _quantized_pair("qwen3_moe")
    experts = next(m for m in model.modules() if "_unsloth_moe" in m.__dict__)
    ref_experts = next(m for m in reference.modules() if "_unsloth_moe" in m.__dict__)
    x = torch.randn(5, experts.gate_up_proj.shape[-1])
    index = torch.tensor([[0, 1], [2, 3], [4, 5], [1, 0], [3, 3]])
    weights = torch.softmax(torch.randn(5, 2), -1)
    with torch.no_grad():
        stock = type(experts).forward(experts, x, index, weights)
        torch.testing.assert_close(stock, type(ref_experts).forward(ref_experts, x, index, weights))
    stack = experts.gate_up_proj
    assert stack.shape == ref_experts.gate_up_proj.shape and stack.dtype == torch.float32
    torch.testing.assert_close(stack * 1, ref_experts.gate_up_proj.data)


@pytest.mark.slow
def test_4bit_stack_moves_and_casts_without_dequantizing():
    model, _ = _quantized_pair("qwen3_moe")
    before = expert_stack_bytes(model)
    model.to(torch.bfloat16)
    stacks = [p for p in model.parameters() if isinstance(p, Nf4Stack)]
    assert stacks and all(s.dtype == torch.bfloat16 and isinstance(s, nn.Parameter) for s in stacks)
    assert expert_stack_bytes(model) == before
    assert isinstance(copy.deepcopy(stacks[0]), Nf4Stack)


def test_writing_into_a_4bit_stack_is_an_error_not_a_lost_write():
    stack = Nf4Stack.quantize(torch.randn(2, 8, 64))
    with pytest.raises(RuntimeError, match="cannot be written in place"):
        stack.add_(1.0)
    with pytest.raises(RuntimeError, match="cannot be written in place"):
        stack.copy_(torch.zeros(2, 8, 64))


@pytest.mark.slow
def test_load_in_4bit_quantizes_the_packed_experts_and_trains_lora_on_them(tmp_path):
    from tiny_families import save_tiny
    from unsloth.models.loader import add_lora, load_pretrained

    path = save_tiny("gpt_oss", tmp_path / "gpt_oss", model=tiny_moe("gpt_oss"))
    model, _ = load_pretrained(str(path), max_seq_length=64, dtype="float32", load_in_4bit=True)
    experts = [m for m in model.modules() if "_unsloth_moe" in m.__dict__]
    assert len(experts) == 2 and all(isinstance(m.down_proj, Nf4Stack) for m in experts)
    assert model._unsloth_patches.moe_4bit == 4
    assert "4 stacks in NF4" in model._unsloth_patches.summary()
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"  # bitsandbytes' part, as before

    reference = copy.deepcopy(model)
    dequantize_packed_experts(reference)
    model, reference = add_lora(model, r=4, lora_alpha=8), add_lora(reference, r=4, lora_alpha=8)
    ids, labels = _batch()
    losses = []
    for m in (model, reference):
        with torch.no_grad():
            for name, p in m.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
        m.train()
        loss = m(input_ids=ids, labels=labels).loss
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
    expert_grads = {n: p.grad for n, p in model.named_parameters() if "experts" in n and "lora_A" in n}
    assert expert_grads and all(g is not None and g.abs().sum() > 0 for g in expert_grads.values())


@pytest.mark.slow
@pytest.mark.parametrize("family,four_bit", [("qwen3_moe", True), ("gpt_oss", False)])
def test_merged_state_dict_of_expert_lora_is_the_adapted_model(family, four_bit):
    """The merged 16-bit export of a MoE model: expert stacks (dequantized where 4-bit) with their
    LoRA delta merged, loaded into a plain transformers model, gives the adapted model's logits."""
    from transformers import AutoModelForCausalLM

    from unsloth.export.merged import merged_state_dict

    model = tiny_moe(family)
    plain = AutoModelForCausalLM.from_config(model.config).eval()
    patch_model(model)
    model.requires_grad_(False)
    if four_bit:
        quantize_packed_experts(model)
    model = _with_lora(model)
    patch_peft_model(model)
    ids, _ = _batch()
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        state = merged_state_dict(model, torch.float32)
        assert not any(isinstance(t, Nf4Stack) for t in state.values())
        plain.load_state_dict(state, strict=True)
        torch.testing.assert_close(plain(input_ids=ids).logits, adapted, rtol=1e-4, atol=1e-4)
        with model.disable_adapter():  # the delta is really there: without it the logits move
            assert not torch.allclose(model(input_ids=ids).logits, adapted, atol=1e-3)


def test_stacks_quantized_expert_by_expert_are_bitsandbytes_own_bytes():
    """Nf4Stack.quantize works one expert at a time (to bound its float32 working copies); the bytes,
    scales and nested scales are those of one bitsandbytes quantize_4bit call on the whole stack."""
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    for shape, dtype in [((6, 32, 64), torch.float32), ((4, 48, 128), torch.bfloat16), ((3, 5, 7), torch.float32)]:
        dense = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
        stack = Nf4Stack.quantize(dense)
        packed, state = quantize_4bit(dense, blocksize=64, compress_statistics=True, quant_type="nf4",
                                      quant_storage=torch.uint8)  # fmt: skip
        assert stack.packed.shape == packed.shape and torch.equal(stack.packed, packed), shape
        ours = stack.quant_state
        assert torch.equal(ours.absmax, state.absmax) and torch.equal(ours.offset, state.offset), shape
        assert torch.equal(ours.state2.absmax, state.state2.absmax) and ours.shape == state.shape, shape
        assert torch.equal(stack.dequantize(), dequantize_4bit(packed, state)), shape


def _cpu_allocation_peak(load):
    """(load(), the peak of torch's CPU allocations while it ran, above what was allocated before), from
    the profiler's running total of allocated bytes. A checkpoint's file mapping is page cache: the
    profiler reports it with a total of 0, and it is left out."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = load()
    events, pending = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        node = pending.pop()
        pending.extend(node.children)
        fields = node.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation" and fields.total_allocated:
            events.append((node.start_time_ns, fields.total_allocated, fields.alloc_size))
    events.sort()
    before = events[0][1] - events[0][2]  # the reporter's total counts what earlier profiled code still holds
    return result, max(total for _, total, _ in events) - before


def _stored_bytes(model):
    return sum(p.nbytes_stored() if isinstance(p, Nf4Stack) else p.numel() * p.element_size()
               for p in model.parameters())  # fmt: skip


@pytest.mark.slow
def test_experts_are_quantized_as_the_checkpoint_loads_so_it_never_holds_the_16bit_experts(tmp_path):
    """A sharded 16-bit MoE checkpoint loaded with 4-bit experts peaks at about the 4-bit model plus
    one layer's 16-bit experts; quantizing after the load (as before) peaks above all the 16-bit experts."""
    import transformers as t

    from unsloth.models.experts_4bit import quantize_experts_on_load
    from unsloth.models.loader import _quantization_config
    from unsloth.models.patches.moe import holds_expert_stacks

    layers = 8
    config = t.Qwen3MoeConfig(vocab_size=64, hidden_size=128, intermediate_size=64, moe_intermediate_size=128,
                              num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                              num_experts=16, num_experts_per_tok=2, norm_topk_prob=True)  # fmt: skip
    torch.manual_seed(0)
    t.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="1MB")
    assert len(list(tmp_path.glob("*.safetensors"))) > layers

    def load():
        return t.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16,
                                                      quantization_config=_quantization_config(True, False, torch.bfloat16))  # fmt: skip

    after, peak_after = _cpu_allocation_peak(load)
    experts_16bit = sum(p.numel() * 2 for n, p in after.named_parameters() if n.endswith(("gate_up_proj", "down_proj")))
    model_16bit = _stored_bytes(after)
    assert peak_after >= model_16bit  # the check can fail: a plain load holds every 16-bit stack
    with quantize_experts_on_load(holds_expert_stacks):
        on_load, peak = _cpu_allocation_peak(load)
    stacks = [p for p in on_load.parameters() if isinstance(p, Nf4Stack)]
    assert len(stacks) == 2 * layers and not any(p.requires_grad for p in stacks)
    model_4bit, one_layer = _stored_bytes(on_load), experts_16bit // layers
    # one layer in flight: its per-expert tensors, their stack, the joined gate/up stack
    assert peak <= model_4bit + 2 * one_layer, (peak, model_4bit, one_layer)
    assert peak < 0.5 * model_16bit, (peak, model_16bit)
    for dense, stack in zip([p for n, p in after.named_parameters() if n.endswith(("gate_up_proj", "down_proj"))], stacks):
        assert torch.equal(stack.dequantize(), Nf4Stack.quantize(dense.data).dequantize())


@pytest.mark.slow
def test_load_in_4bit_quantizes_while_loading_as_the_after_load_path_did(tmp_path, monkeypatch):
    """load_pretrained(load_in_4bit=True) on a sharded checkpoint: transformers hands back experts
    already in NF4; the model (bytes, outputs) equals the one quantized after the load."""
    import contextlib

    from transformers import AutoModelForCausalLM

    from tiny_families import save_tiny
    from unsloth.models import loader

    path = save_tiny("qwen3_moe", tmp_path / "qwen3_moe", model=tiny_moe("qwen3_moe"), max_shard_size="20KB")
    assert len(list(path.glob("*.safetensors"))) > 2
    loaded = []

    class Recorded:  # AutoModelForCausalLM, noting which stacks came back from transformers' load in NF4
        _model_mapping = AutoModelForCausalLM._model_mapping

        @staticmethod
        def from_pretrained(*args, **kwargs):
            model = AutoModelForCausalLM.from_pretrained(*args, **kwargs)
            loaded.append(sum(isinstance(p, Nf4Stack) for p in model.parameters()))
            return model

    def load():
        return loader.load_pretrained(str(path), max_seq_length=64, dtype="float32", load_in_4bit=True,
                                      auto_class=Recorded)[0]  # fmt: skip

    on_load = load()
    monkeypatch.setattr(loader, "_experts_in_4bit_while_loading", lambda wanted: contextlib.nullcontext())
    after = load()
    stacks = 2 * on_load.config.num_hidden_layers
    assert loaded == [stacks, 0]
    assert on_load._unsloth_patches.moe_4bit == after._unsloth_patches.moe_4bit == stacks
    ours = {n: p for n, p in on_load.named_parameters() if isinstance(p, Nf4Stack)}
    theirs = {n: p for n, p in after.named_parameters() if isinstance(p, Nf4Stack)}
    assert ours.keys() == theirs.keys() and len(ours) == stacks
    for name, stack in ours.items():
        assert torch.equal(stack.packed, theirs[name].packed), name
        assert torch.equal(stack.quant_state.absmax, theirs[name].quant_state.absmax), name
    ids, _ = _batch()
    with torch.no_grad():
        assert torch.equal(on_load(input_ids=ids).logits, after(input_ids=ids).logits)
