"""The fast generation path (static cache kept between calls) against transformers' own generate."""

from __future__ import annotations

import pytest
import torch

from tiny_families import VOCAB, has_tiny_config, tiny_model, with_lora
from unsloth.models import generation
from unsloth.models.patches import FAMILIES, patch_model, patch_peft_model

# The registry also names multimodal model types (gemma4, qwen3_5) whose text models are the tiny ones here.
FAMILY_NAMES = sorted(f for f in FAMILIES if has_tiny_config(f))


def _prompts(batch=2, seq=7, seed=1):
    ids = torch.randint(2, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding on one row, as batched prompts have
    return ids, mask


def _with_lora(model):
    peft_model = with_lora(model, b_std=0.2)  # large enough to change the greedy tokens
    patch_peft_model(peft_model)
    return peft_model


def _greedy(model, ids, mask, new=6):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                          pad_token_id=0, eos_token_id=None)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_greedy_tokens_match_transformers(family):
    model = tiny_model(family)
    patch_model(model)
    ids, mask = _prompts()
    for adapters in (False, True):
        if adapters:
            model = _with_lora(model)
        expected = _greedy(model, ids, mask)
        generation.enable(model)
        assert generation.enabled(model)
        assert torch.equal(_greedy(model, ids, mask), expected), f"adapters={adapters}"
        generation.disable(model)


def test_the_cache_is_kept_per_batch_and_bucket_and_reused():
    model = tiny_model("llama")
    generation.enable(model)
    caches = model._unsloth_fast_generation
    ids, mask = _prompts(seq=5)
    first = _greedy(model, ids, mask, new=4)
    assert list(caches) == [(2, generation.BUCKET)]
    cache = caches[(2, generation.BUCKET)]
    ids2, mask2 = _prompts(seq=9, seed=3)  # another prompt length in the same bucket: the same cache
    _greedy(model, ids2, mask2, new=3)
    assert caches[(2, generation.BUCKET)] is cache and len(caches) == 1
    assert torch.equal(_greedy(model, ids, mask, new=4), first)  # a reused cache leaves nothing behind
    single, single_mask = _prompts(batch=1, seq=12, seed=5)  # another batch size: its own cache
    fast = _greedy(model, single, single_mask, new=5)
    assert set(caches) == {(2, generation.BUCKET), (1, generation.BUCKET)}
    generation.disable(model)
    assert not generation.enabled(model) and "generate" not in model.__dict__
    assert torch.equal(fast, _greedy(model, single, single_mask, new=5))


def test_cache_lengths_round_up_to_the_bucket():
    assert generation.cache_length(1) == generation.BUCKET
    assert generation.cache_length(generation.BUCKET) == generation.BUCKET
    assert generation.cache_length(512 + 128) == 3 * generation.BUCKET


@pytest.mark.slow
def test_sampling_with_a_seed_is_reproducible_and_honours_the_options():
    from transformers import StoppingCriteria

    model = tiny_model("llama")
    patch_model(model)
    model = _with_lora(model)
    ids, mask = _prompts()
    options = dict(do_sample=True, temperature=0.8, top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.3,
                   max_new_tokens=8, pad_token_id=0, eos_token_id=None)
    torch.manual_seed(7)
    expected = model.generate(input_ids=ids, attention_mask=mask, **options)
    generation.enable(model)
    torch.manual_seed(7)
    first = model.generate(input_ids=ids, attention_mask=mask, **options)
    torch.manual_seed(7)
    again = model.generate(input_ids=ids, attention_mask=mask, **options)
    assert torch.equal(first, again) and torch.equal(first, expected)

    class StopAfter(StoppingCriteria):  # user stopping criteria still run on the fast path
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= ids.shape[1] + 3, dtype=torch.bool)

    stopped = model.generate(input_ids=ids, attention_mask=mask, stopping_criteria=[StopAfter()], **options)
    assert stopped.shape[1] == ids.shape[1] + 3


def test_a_streamer_sees_the_tokens_of_the_fast_path():
    model = tiny_model("llama")
    generation.enable(model)
    ids = torch.randint(2, VOCAB, (1, 6), generator=torch.Generator().manual_seed(4))
    seen = []

    class Streamer:
        def put(self, value):
            seen.append(value.reshape(-1).tolist())

        def end(self):
            seen.append("end")

    out = model.generate(input_ids=ids, max_new_tokens=5, do_sample=False, streamer=Streamer(), pad_token_id=0,
                         eos_token_id=None)
    assert seen[0] == ids[0].tolist() and seen[-1] == "end"
    assert sum(seen[1:-1], []) == out[0, 6:].tolist()


@pytest.mark.slow
def test_for_inference_and_back_leaves_training_unchanged():
    from unsloth import FastLanguageModel

    model = tiny_model("llama")
    patch_model(model)
    model = _with_lora(model)
    ids, mask = _prompts(seq=10)
    labels = ids.masked_fill(mask == 0, -100)

    def loss_and_grads():
        model.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    FastLanguageModel.for_training(model)
    loss, grads = loss_and_grads()
    for _ in range(2):  # back and forth, generating in between
        FastLanguageModel.for_inference(model)
        assert not model.training and generation.enabled(model)
        _greedy(model, ids, mask)
        FastLanguageModel.for_training(model)
        assert model.training and not generation.enabled(model)
        again, again_grads = loss_and_grads()
        assert torch.equal(again, loss)
        assert again_grads.keys() == grads.keys()
        assert all(torch.equal(again_grads[n], g) for n, g in grads.items())


def test_a_decode_step_that_cannot_compile_falls_back_to_eager_once(caplog):
    from torch._dynamo.exc import Unsupported

    model = tiny_model("llama")
    ids, mask = _prompts()
    expected = _greedy(model, ids, mask, new=3)
    real, compiled_tries = model.generate, []

    def generate_failing_to_compile(*args, generation_config, **kwargs):  # as generate does with a layer dynamo refuses
        if not generation_config.disable_compile:
            compiled_tries.append(1)
            raise Unsupported("a layer dynamo cannot trace")
        return real(*args, generation_config=generation_config, **kwargs)

    model.generate = generate_failing_to_compile
    generation.enable(model)
    with caplog.at_level("WARNING", logger="unsloth"):
        assert torch.equal(_greedy(model, ids, mask, new=3), expected)
        assert torch.equal(_greedy(model, ids, mask, new=3), expected)
    assert len(compiled_tries) == 1 and "could not be compiled" in caplog.text
    generation.disable(model)
    assert model.generate is generate_failing_to_compile


@pytest.mark.slow
def test_greedy_tokens_match_transformers_in_4bit_with_adapters(tmp_path):
    pytest.importorskip("bitsandbytes")
    from tiny_families import save_tiny
    from unsloth.models.loader import add_lora, load_pretrained

    model, _ = load_pretrained(str(save_tiny("llama", tmp_path / "llama")), max_seq_length=64, dtype="float32",
                               load_in_4bit=True)
    model = add_lora(model, r=4, lora_alpha=8)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    assert type(model.get_base_model().model.layers[0].mlp.gate_proj.base_layer).__name__ == "Linear4bit"
    model.eval()
    ids, mask = _prompts()
    expected = _greedy(model, ids, mask)
    generation.enable(model)
    assert torch.equal(_greedy(model, ids, mask), expected)


def _decode_step_compiles_to_one_graph(backbone):
    """Prefill eagerly on a fresh static cache, then one token: eager vs torch.compile(fullgraph=True)
    (any graph break is an error), the same logits."""
    from transformers import StaticCache

    ids, _ = _prompts(batch=1, seq=5)

    def decode_step(forward):
        cache = StaticCache(config=backbone.config, max_cache_len=16)
        backbone(input_ids=ids, past_key_values=cache, use_cache=True)
        return forward(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True,
                       cache_position=torch.tensor([5]), position_ids=torch.tensor([[5]])).logits

    with torch.no_grad():
        eager = decode_step(backbone)
        torch._dynamo.reset()
        compiled = decode_step(torch.compile(backbone, backend="eager", fullgraph=True))
    torch.testing.assert_close(compiled, eager)


@pytest.mark.slow
def test_the_patched_decode_step_traces_as_one_graph_with_the_same_logits():
    """Under torch.compile our patched forwards take their plain torch form: a decode step with LoRA on
    a static cache is one graph (no break to pay eager host time for between CUDA graphs)."""
    model = tiny_model("llama")
    report = patch_model(model)
    assert report.rms_norm and report.rope and report.mlp, report  # else the test would prove nothing
    _decode_step_compiles_to_one_graph(_with_lora(model).get_base_model())


@pytest.mark.slow
def test_a_4bit_decode_step_with_adapters_traces_as_one_graph(tmp_path):
    """What lets fast_generate compile a bitsandbytes 4-bit model's decode step, which transformers
    itself never does: bitsandbytes' 4-bit layers under LoRA trace without a break."""
    pytest.importorskip("bitsandbytes")
    from tiny_families import save_tiny
    from unsloth.models.loader import add_lora, load_pretrained

    model, _ = load_pretrained(str(save_tiny("llama", tmp_path / "llama")), max_seq_length=64, dtype="float32",
                               load_in_4bit=True)
    model = add_lora(model, r=4, lora_alpha=8)
    backbone = model.get_base_model()
    assert type(backbone.model.layers[0].mlp.gate_proj.base_layer).__name__ == "Linear4bit"
    _decode_step_compiles_to_one_graph(backbone.eval())


def test_the_4bit_quantizer_is_hidden_from_transformers_compile_check_only_on_a_gpu():
    import types

    quantizer = types.SimpleNamespace(quantization_config=types.SimpleNamespace(load_in_4bit=True))
    gpu = types.SimpleNamespace(device=torch.device("cuda"), hf_quantizer=quantizer)
    assert generation._hide_bitsandbytes_4bit(gpu) is quantizer and gpu.hf_quantizer is None
    cpu = types.SimpleNamespace(device=torch.device("cpu"), hf_quantizer=quantizer)  # nothing compiles there
    assert generation._hide_bitsandbytes_4bit(cpu) is None and cpu.hf_quantizer is quantizer
    eight = types.SimpleNamespace(device=torch.device("cuda"), hf_quantizer=types.SimpleNamespace(
        quantization_config=types.SimpleNamespace(load_in_4bit=False)))
    assert generation._hide_bitsandbytes_4bit(eight) is None
