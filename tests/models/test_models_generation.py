"""The fast generation path (static cache kept between calls) against transformers' own generate."""

from __future__ import annotations

import contextlib
import copy
import os
import types

import pytest
import torch

from test_models_moe import _with_lora as _with_moe_lora
from test_models_moe import moe_config
from tiny_families import (VOCAB, compile_decode_as_on_a_gpu, family_config, save_tiny, tiny_model,
                           transformers_attention, with_lora)
from tiny_vision import VISION_FAMILIES, tiny_vision_model
from unsloth.models import generation
from unsloth.models.patches import FAMILIES, MOE_FAMILIES, patch_model, patch_peft_model

# Families whose model class has a generate of its own, which the fast path leaves in place (enable keeps it).
OWN_GENERATE = {"csm"}  # Sesame CSM writes audio frames through its depth decoder
NEEDS_TIMM = {"gemma3n"}  # the whole Gemma 3n: its vision tower is built by timm, not installed here
# Every other registry entry, dense and MoE (gemma4_text is in both: its dense and its MoE variant).
REGISTERED = ([("dense", f) for f in FAMILIES if f not in OWN_GENERATE | NEEDS_TIMM]
              + [("moe", f) for f in MOE_FAMILIES])
# Multimodal model types whose language model is one of the tiny text ones, with a 1-block vision tower.
MULTIMODAL = {"qwen3_5": ("qwen3_5_text", "Qwen3_5Config"), "llama4": ("llama4_text", "Llama4Config")}
_TOWERS = {
    "qwen3_5": dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=8,
                    spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16),
    "llama4": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                   patch_size=8, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32),
}
# 4-bit, CI runs one family of each kind of layer (dense, fused gate-and-up MLP, Gemma's norms and
# softcapping, Gated DeltaNet, vision-language, packed and per-expert MoE); the whole registry with
# UNSLOTH_TEST_EVERY_FAMILY=1 (bitsandbytes' CPU path makes each case tens of seconds).
FOUR_BIT_SAMPLE = {("dense", "llama"), ("dense", "qwen3"), ("dense", "phi3"), ("dense", "gemma3_text"),
                   ("dense", "gemma4_text"), ("dense", "qwen3_5_text"), ("dense", "qwen2_5_vl"), ("moe", "gpt_oss"),
                   ("moe", "qwen3_moe"), ("moe", "mixtral")}
FOUR_BIT = REGISTERED if os.environ.get("UNSLOTH_TEST_EVERY_FAMILY") == "1" else [
    case for case in REGISTERED if case in FOUR_BIT_SAMPLE]
_TEXT_TARGETS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def registered_model(kind: str, family: str):
    """A tiny random model of registry entry (kind, family), float32, eval mode."""
    import transformers

    if kind == "moe" and family not in MULTIMODAL:
        from test_models_moe import tiny_moe

        model = tiny_moe(family)
        model.config.output_router_logits = False  # transformers' own generate fails with it (its aux loss)
        return model
    if family in VISION_FAMILIES:
        return tiny_vision_model(family)[0]
    if family == "gemma3n_text":
        from tiny_vision import build_tokenizer, gemma3n_text_config

        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(gemma3n_text_config(build_tokenizer("gemma3n"))).eval()
    if family in MULTIMODAL:
        text, config_class = MULTIMODAL[family]
        text_config = (moe_config(text) if kind == "moe" else family_config(text)).to_dict()
        config = getattr(transformers, config_class)(text_config=text_config, vision_config=_TOWERS[family])
        torch.manual_seed(0)
        return transformers.AutoModelForImageTextToText.from_config(config).eval()
    return tiny_model(family)


# Registry entries whose tiny model is already a vision-language one (a vision tower in its config)
TINY_MULTIMODAL = {"mistral3"}


def _multimodal(family: str) -> bool:
    return family in VISION_FAMILIES or family in MULTIMODAL or family in TINY_MULTIMODAL


def _adapters(kind: str, family: str, model):
    """LoRA (B drawn non-zero, large enough to change the greedy tokens) on the language model's projections
    (and a MoE model's experts)."""
    if _multimodal(family):
        return with_lora(model, target_modules=_TEXT_TARGETS, b_std=0.2)
    return _with_moe_lora(model) if kind == "moe" else with_lora(model, b_std=0.2)


def _prompts(batch=2, seq=7, seed=1):
    ids = torch.randint(2, VOCAB - 10, (batch, seq), generator=torch.Generator().manual_seed(seed))
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


def _transformers_greedy(model, ids, mask, new):
    """transformers' own generate, the reference; skips where it cannot generate at all (nothing to match)."""
    try:
        with transformers_attention():
            return _greedy(model, ids, mask, new=new)
    except AttributeError as error:  # Llama4ForConditionalGeneration, text only: no image_outputs (5.24)
        pytest.skip(f"transformers' own generate fails on {model.config.model_type}: {error}")


def test_every_registered_family_has_a_tiny_model():
    for kind, family in REGISTERED:
        assert registered_model(kind, family).config.model_type == family, (kind, family)


def test_a_family_with_its_own_generate_keeps_it():
    from tiny_csm import tiny_csm

    assert OWN_GENERATE | NEEDS_TIMM <= set(FAMILIES)
    model, _ = tiny_csm()
    generation.enable(model)
    assert not generation.enabled(model) and "generate" not in model.__dict__ and model.config.use_cache


@pytest.mark.slow
@pytest.mark.parametrize("kind, family", REGISTERED, ids=[f"{k}-{f}" for k, f in REGISTERED])
def test_greedy_tokens_match_transformers(kind, family):
    """Ours (family patches, our LoRA path, the fast generation path) against transformers + peft on an
    unpatched copy with the same weights: the same greedy tokens, without and with adapters."""
    reference = registered_model(kind, family)
    ours = copy.deepcopy(reference)
    assert patch_model(ours).skipped is None
    ids, mask = _prompts()
    for adapters in (False, True):
        if adapters:
            reference, ours = _adapters(kind, family, reference), _adapters(kind, family, ours)
            assert patch_peft_model(ours).lora, "no LoRA layer on our path: the test would prove less"
        expected = _transformers_greedy(reference, ids, mask, new=4)
        generation.enable(ours)
        assert generation.enabled(ours)
        assert torch.equal(_greedy(ours, ids, mask, new=4), expected), f"adapters={adapters}"
        assert ours.get_base_model()._unsloth_fast_generation if adapters else ours._unsloth_fast_generation
        generation.disable(ours)


@pytest.mark.slow
@pytest.mark.parametrize("kind, family", FOUR_BIT, ids=[f"{k}-{f}" for k, f in FOUR_BIT])
def test_greedy_tokens_match_transformers_in_4bit_with_adapters(kind, family, tmp_path):
    """QLoRA: loaded in 4-bit by our loader (bitsandbytes' layers; a MoE model's packed experts in NF4),
    LoRA on top: the fast path's greedy tokens are transformers' generate's on the same model."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from unsloth.models.loader import add_lora, load_pretrained

    folder = save_tiny(family, tmp_path / family, model=registered_model(kind, family))
    options = dict(auto_class=AutoModelForImageTextToText, load_tokenizer=AutoTokenizer.from_pretrained) \
        if _multimodal(family) else {}
    model, _ = load_pretrained(str(folder), max_seq_length=64, dtype="float32", load_in_4bit=True, **options)
    assert any(type(m).__name__ == "Linear4bit" for m in model.modules())
    model = add_lora(model, r=4, lora_alpha=8, random_state=0,
                     **({"target_modules": _TEXT_TARGETS} if _multimodal(family) else {}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    model.eval()
    ids, mask = _prompts()
    expected = _transformers_greedy(model, ids, mask, new=4)
    generation.enable(model)
    assert torch.equal(_greedy(model, ids, mask, new=4), expected)
    assert model.get_base_model()._unsloth_fast_generation


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


def _options_generate_sees(kwargs):
    """The generation options a `generate(**kwargs)` call runs with, before the model's defaults fill its gaps."""
    from transformers import GenerationConfig

    config = copy.deepcopy(kwargs.get("generation_config") or GenerationConfig())
    config.update(**{key: value for key, value in kwargs.items() if key != "generation_config"})
    return config


def test_an_explicit_none_overrides_the_models_default_as_in_generate(caplog):
    """eos_token_id=None in the call means "no stop token" to generate, though the model's generation_config
    names one; the fast path keeps it so (a config carrying the None is filled from the model's default).
    A generation_config passed in is honoured too, without generate's warning about options beside it."""
    from transformers import GenerationConfig

    model = tiny_model("llama")
    patch_model(model)
    ids, mask = _prompts()
    first = _greedy(model, ids, mask, new=1)[0, -1].item()
    model.generation_config.eos_token_id = first  # the model's default stop token: the first one greedy picks
    expected = _greedy(model, ids, mask, new=4)  # eos_token_id=None
    assert expected.shape[1] == ids.shape[1] + 4 and expected[0, ids.shape[1]] == first
    generation.enable(model)
    assert torch.equal(_greedy(model, ids, mask, new=4), expected)
    stopped = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert stopped[0, ids.shape[1] + 1:].eq(0).all(), "the model's own stop token no longer stops the row"
    config = GenerationConfig(max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=-1)
    with caplog.at_level("WARNING"):
        given = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    assert torch.equal(given, expected[:, :ids.shape[1] + 3]) and "together with" not in caplog.text
    assert config.cache_implementation is None and config.compile_config is None, "the caller's config changed"
    generation.disable(model)
    seen, real = [], model.generate

    def recording(*args, **kwargs):
        seen.append(_options_generate_sees(kwargs))
        return real(*args, **kwargs)

    model.generate = recording
    generation.enable(model)
    config.disable_compile, config.cache_implementation = True, "static"  # as TRL's rollouts ask: ours win
    for options in ({"generation_config": config}, {"generation_config": config, "disable_compile": True},
                    {"disable_compile": True, "cache_implementation": "static", "max_new_tokens": 2}):
        model.generate(input_ids=ids, attention_mask=mask, **options)
        assert seen[-1].disable_compile is False and seen[-1].cache_implementation is None, options


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

    def generate_failing_to_compile(*args, **kwargs):  # as generate does with a layer dynamo refuses
        if not _options_generate_sees(kwargs).disable_compile:
            compiled_tries.append(1)
            raise Unsupported("a layer dynamo cannot trace")
        return real(*args, **kwargs)

    model.generate = generate_failing_to_compile
    generation.enable(model)
    with caplog.at_level("WARNING", logger="unsloth"):
        assert torch.equal(_greedy(model, ids, mask, new=3), expected)
        assert torch.equal(_greedy(model, ids, mask, new=3), expected)
    assert len(compiled_tries) == 1 and "could not be compiled" in caplog.text
    generation.disable(model)
    assert model.generate is generate_failing_to_compile


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
    quantizer = types.SimpleNamespace(quantization_config=types.SimpleNamespace(load_in_4bit=True))
    gpu = types.SimpleNamespace(device=torch.device("cuda"), hf_quantizer=quantizer)
    assert generation._hide_bitsandbytes_4bit(gpu) is quantizer and gpu.hf_quantizer is None
    cpu = types.SimpleNamespace(device=torch.device("cpu"), hf_quantizer=quantizer)  # nothing compiles there
    assert generation._hide_bitsandbytes_4bit(cpu) is None and cpu.hf_quantizer is quantizer
    eight = types.SimpleNamespace(device=torch.device("cuda"), hf_quantizer=types.SimpleNamespace(
        quantization_config=types.SimpleNamespace(load_in_4bit=False)))
    assert generation._hide_bitsandbytes_4bit(eight) is None


@pytest.mark.slow
def test_new_prompt_lengths_and_batches_reuse_the_compiled_decode_step(monkeypatch, caplog):
    """The decode step compiled as on a GPU (shapes specialized), here with dynamo's eager backend on the
    CPU: a new prompt length or max_new_tokens in the same bucket compiles nothing more, a new batch
    size once, and going back to an earlier batch size nothing. Each compile is announced, once."""
    import logging

    from torch._dynamo.utils import counters

    caplog.set_level(logging.INFO, logger="unsloth")
    model = _with_lora(tiny_model("llama"))
    patch_model(model.get_base_model())
    expected = {seq: _greedy(model, *_prompts(batch, seq, seed=seq), new=new)
                for batch, seq, new in ((2, 5, 6), (2, 9, 3), (1, 12, 5), (1, 4, 7))}
    assert generation._compile_config(model.get_base_model()) is None  # on the CPU: no compiling by default
    compile_decode_as_on_a_gpu(monkeypatch)
    generation.enable(model)
    torch._dynamo.reset()
    counters.clear()

    def graphs(batch, seq, new):
        assert torch.equal(_greedy(model, *_prompts(batch, seq, seed=seq), new=new), expected[seq])
        return counters["stats"]["unique_graphs"]

    first = graphs(2, 5, 6)
    assert 0 < first < 5, "not compiled, or compiled again at every decode step"
    assert graphs(2, 9, 3) == first  # another prompt length and max_new_tokens, same (batch, bucket)
    batch_one = graphs(1, 12, 5)
    assert first < batch_one <= 2 * first  # a new batch size: its own graphs, once
    assert graphs(1, 4, 7) == batch_one
    assert graphs(2, 5, 6) == batch_one  # back to batch 2: its graphs were kept
    said = [r.getMessage() for r in caplog.records if "compiling the decode step" in r.getMessage()]
    assert len(said) == 2 and "for 2 rows and" in said[0] and "for 1 row and" in said[1], said


@pytest.mark.slow
def test_a_shape_decoded_with_guards_skips_them_after_until_the_adapters_switch(monkeypatch):
    """Once a (batch, bucket) has decoded with dynamo's guards, its later calls skip them (the compiled step
    only), a new batch size being guarded first; a call in other modes (inside `disable_adapter()`) runs with
    every guard, and from then on every call does: the base model's tokens there, the adapters' after."""
    import functools

    model = _with_lora(tiny_model("llama"))
    patch_model(model.get_base_model())
    ids, mask = _prompts(batch=2, seq=6)
    expected = _greedy(model, ids, mask, new=5)
    with model.disable_adapter():
        base = _greedy(model, ids, mask, new=5)
    assert not torch.equal(base, expected)  # the adapters change the tokens: the check below can fail
    compile_decode_as_on_a_gpu(monkeypatch)
    generation.enable(model)
    torch._dynamo.reset()
    set_stance, skipping = torch.compiler.set_stance, []

    @functools.wraps(set_stance)
    def spy(*args, **kwargs):
        skipping.append(kwargs.get("skip_guard_eval_unsafe", False))
        return set_stance(*args, **kwargs)

    monkeypatch.setattr(torch.compiler, "set_stance", spy)

    def skipped(reference, adapters=True, rows=2):
        before = len(skipping)
        with contextlib.nullcontext() if adapters else model.disable_adapter():
            assert torch.equal(_greedy(model, ids[:rows], mask[:rows], new=5), reference[:rows])
        return sum(skipping[before:])

    assert skipped(expected) == 0  # the first call decodes with the guards
    assert skipped(expected) == 4  # then each of its 4 compiled steps skips them
    assert skipped(expected, rows=1) == 0  # a new batch size: guarded first (graphs of its own)
    assert skipped(expected, rows=1) == 4
    assert skipped(expected) == 4  # the kept graphs told apart by their sizes
    monkeypatch.setattr(generation, "SKIP_GUARDS", False)  # UNSLOTH_DECODE_SKIP_GUARDS=0
    assert skipped(expected) == 0
    monkeypatch.setattr(generation, "SKIP_GUARDS", True)
    assert skipped(base, adapters=False) == 0  # adapters off: other modes, guarded
    assert skipped(base, adapters=False) == 0  # and from now on every call is
    assert skipped(expected) == 0


@pytest.mark.slow
def test_decoding_after_checkpointed_training_steps_compiles_once(monkeypatch):
    """GRPO trains, then generates, then trains: what training leaves behind (the checkpoint's hooks
    and kept lists) must not move a guard of the compiled decode step, or it recompiles at every token."""
    from torch._dynamo.utils import counters

    from unsloth.models.checkpointing import apply_gradient_checkpointing

    monkeypatch.setenv("UNSLOTH_KERNELS", "0")
    model = _with_lora(tiny_model("llama"))
    apply_gradient_checkpointing(model.get_base_model(), True)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids, mask = _prompts(batch=2, seq=6)

    def train_step():
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    train_step()
    compile_decode_as_on_a_gpu(monkeypatch)
    generation.enable(model)
    torch._dynamo.reset()
    counters.clear()
    _greedy(model, ids, mask, new=5)
    first = counters["stats"]["unique_graphs"]
    assert 0 < first < 5
    for _ in range(2):
        train_step()
        _greedy(model, ids, mask, new=5)
    assert counters["stats"]["unique_graphs"] == first


@pytest.mark.slow
@pytest.mark.parametrize("option", [dict(temperature=0.7), dict(top_p=0.8), dict(top_k=5), dict(min_p=0.2),
                                    dict(repetition_penalty=1.5)], ids=lambda o: next(iter(o)))
def test_each_sampling_option_is_honoured_as_transformers_does(option):
    """Seeded sampling with one option at a time: the fast path's tokens are plain generate's with that
    option, and (so the option is not merely ignored by both) they differ from the tokens without it."""
    model = tiny_model("llama")
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)  # peaked next-token distributions: a random model's are nearly flat
    ids, mask = _prompts()
    base = dict(do_sample=True, max_new_tokens=10, pad_token_id=0, eos_token_id=None, top_k=0, temperature=1.0)

    def sample(**options):
        torch.manual_seed(11)
        return model.generate(input_ids=ids, attention_mask=mask, **{**base, **options})

    expected, without = sample(**option), sample()
    assert not torch.equal(expected, without)
    generation.enable(model)
    assert torch.equal(sample(**option), expected)
    assert torch.equal(sample(), without)


@pytest.mark.slow
def test_stop_strings_stop_the_fast_path_as_they_stop_generate():
    """Stop strings are matched on text: with the tokenizer passed, or the one the loader attached to the
    model (TRL passes none)."""
    from unsloth.training.demo import build_tokenizer

    tokenizer = build_tokenizer(["the quick brown fox jumps over the lazy dog", "a stop string ends it"], VOCAB)
    model = tiny_model("llama")
    ids = torch.randint(2, len(tokenizer), (1, 6), generator=torch.Generator().manual_seed(4))
    options = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    full = model.generate(input_ids=ids, **options)[0, 6:].tolist()
    # a later new token's text (byte-level pieces of a character decode to U+FFFD: not text to match)
    stop = next(text for text in map(tokenizer.decode, ([t] for t in full[2:]))
                if text.strip() and text.isprintable() and "\ufffd" not in text)
    expected = model.generate(input_ids=ids, stop_strings=[stop], tokenizer=tokenizer, **options)
    assert expected.shape[1] < 6 + 12, "the stop string did not stop plain generate"
    generation.enable(model)
    assert torch.equal(model.generate(input_ids=ids, stop_strings=[stop], tokenizer=tokenizer, **options), expected)
    model._unsloth_tokenizer = tokenizer
    assert torch.equal(model.generate(input_ids=ids, stop_strings=[stop], **options), expected)


def test_transformers_text_streamer_prints_the_fast_paths_text(tmp_path, capsys):
    from transformers import AutoTokenizer, TextStreamer

    tokenizer = AutoTokenizer.from_pretrained(save_tiny("llama", tmp_path / "llama"))
    model = generation.enable(tiny_model("llama"))
    ids = torch.randint(2, VOCAB, (1, 6), generator=torch.Generator().manual_seed(4))
    out = model.generate(input_ids=ids, max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=None,
                         streamer=TextStreamer(tokenizer, skip_prompt=True))
    assert capsys.readouterr().out.split() == tokenizer.decode(out[0, 6:]).split()


def test_the_stop_check_is_deferred_on_cuda_inside_fast_calls_only():
    from transformers.generation.utils import DeferredStopCheck

    assert generation._defer_stop_checks()
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert not DeferredStopCheck.is_supported(cuda, None, False, is_assistant=False)  # transformers' own choice
    generation._CALLS.depth = 1
    try:
        assert DeferredStopCheck.is_supported(cuda, None, False, is_assistant=False)
        assert not DeferredStopCheck.is_supported(cuda, None, False, is_assistant=True)
        assert not DeferredStopCheck.is_supported(cpu, None, False, is_assistant=False)  # no events on a CPU
    finally:
        generation._CALLS.depth = 0
    cache = generation._new_cache(tiny_model("llama"), generation.BUCKET)
    cache._is_user_defined = True  # what generate writes on a cache it is passed: ours is not the caller's
    assert cache._is_user_defined is False


class _CpuEvent:
    """torch.Event where the CPU has none: its work is done when a call returns (the deferred stop check's)."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args):
        pass

    def synchronize(self):
        pass


def test_one_sample_draws_as_torch_multinomial_without_its_checks_outside_our_calls_untouched(monkeypatch):
    """torch.multinomial(p, 1) reads two checks back to the host per token; inside our calls on DEFER_DEVICES
    the same draws (same generator, same tokens) come without them, and outside everything is torch's."""
    assert generation._sample_without_readback()
    original = torch.multinomial._unsloth_original
    probs = torch.softmax(torch.randn(5, 300, generator=torch.Generator().manual_seed(2)) * 4, dim=-1)
    for seed in range(20):
        for p in (probs, probs[seed % 5]):
            drawn = generation._draw_one(p, torch.Generator().manual_seed(seed))
            assert torch.equal(drawn, original(p, 1, generator=torch.Generator().manual_seed(seed)))
    bad = torch.tensor([[0.5, float("nan")]])
    with pytest.raises(RuntimeError, match="inf.*nan"):
        torch.multinomial(bad, 1)  # not in a call of ours: torch's checks, at once
    monkeypatch.setattr(generation, "DEFER_DEVICES", {"cuda", "cpu"})
    generation._CALLS.depth, generation._CALLS.invalid = 1, None
    try:
        torch.manual_seed(7)
        drawn = torch.multinomial(probs, num_samples=1)
        assert torch.equal(drawn, original(probs, 1, generator=torch.Generator().manual_seed(7)))
        assert not generation._CALLS.invalid
        torch.multinomial(bad, 1)  # kept on the device ...
        assert generation._CALLS.invalid
        assert torch.multinomial(probs, 3).shape == (5, 3)  # more than one sample: torch's own
        graphs = []
        draw = torch.compile(lambda p: torch.multinomial(p, 1), fullgraph=True,
                             backend=lambda gm, example_inputs: graphs.append(gm) or gm.forward)  # fmt: skip
        draw(probs)  # a compiled caller traces torch's op as before, in one graph
        assert any(node.target is original for node in graphs[0].graph.nodes)
    finally:
        generation._CALLS.depth, generation._CALLS.invalid = 0, None


def test_a_sampled_token_reads_back_only_the_late_stop_flag(monkeypatch):
    """Per sampled token the host reads one value back (the stop flag, a step late: aten._local_scalar_dense,
    what `.item()` dispatches to, over 4 and 12 tokens), and aten.multinomial, whose one-sample path reads
    two checks back inside the op (out of a dispatch mode's sight), is not called at all."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.reads = self.multinomials = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.reads += func is torch.ops.aten._local_scalar_dense.default
            self.multinomials += func.overloadpacket is torch.ops.aten.multinomial
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(torch, "Event", _CpuEvent)
    monkeypatch.setattr(generation, "DEFER_DEVICES", {"cuda", "cpu"})
    model = tiny_model("llama")
    ids, mask = _prompts()
    generation.enable(model)

    def ops(new):
        with Ops() as seen:
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=True, top_k=0, pad_token_id=0, eos_token_id=[1])  # fmt: skip
        return seen

    ops(4)  # the first call reads a few values once more
    few, more = ops(4), ops(12)
    assert more.reads - few.reads == 8 and few.multinomials == more.multinomials == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU's own multinomial")
def test_one_sample_draws_on_the_gpu_as_torch_multinomial():
    """The install probe runs on the CPU; ATen's one-sample path is the same code on CUDA, which this checks."""
    assert generation._sample_without_readback()
    probs = torch.softmax(torch.randn(8, 128256, device="cuda") * 3, dim=-1)
    for seed in range(5):
        want = torch.multinomial._unsloth_original(probs, 1, generator=torch.Generator("cuda").manual_seed(seed))
        assert torch.equal(generation._draw_one(probs, torch.Generator("cuda").manual_seed(seed)), want)


def test_a_sampled_call_with_invalid_probabilities_says_so_at_its_end(monkeypatch):
    """The checks a draw skipped are raised when the fast call ends: NaN scores do not pass as tokens."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class NaNScores(LogitsProcessor):
        def __call__(self, input_ids, scores):
            return torch.full_like(scores, float("nan"))

    monkeypatch.setattr(torch, "Event", _CpuEvent)
    monkeypatch.setattr(generation, "DEFER_DEVICES", {"cuda", "cpu"})
    model = tiny_model("llama")
    ids, mask = _prompts()
    generation.enable(model)
    options = dict(max_new_tokens=4, do_sample=True, top_k=0, pad_token_id=0, eos_token_id=None,
                   logits_processor=LogitsProcessorList([NaNScores()]))
    with pytest.raises(RuntimeError, match="sampled tokens are not valid"):
        model.generate(input_ids=ids, attention_mask=mask, **options)
    assert not generation._CALLS.depth and generation._CALLS.invalid is None
    out = model.generate(input_ids=ids, attention_mask=mask, **{**options, "logits_processor": None})
    assert out.shape == (2, ids.shape[1] + 4)  # the next call starts with clean checks


@pytest.mark.parametrize("stop_early,sample", [(False, False), (True, False), (False, True)],
                         ids=["greedy", "greedy-eos", "sampled"])
def test_deferred_stop_checks_give_transformers_tokens(monkeypatch, stop_early, sample):
    """Deferred as on CUDA (the CPU runs in order, so events are no-ops): the same tokens as generate,
    also when rows stop at EOS and the step past the stop is undone, and seeded sampling the same."""
    from transformers.generation import utils

    monkeypatch.setattr(torch, "Event", _CpuEvent)
    monkeypatch.setattr(generation, "DEFER_DEVICES", {"cuda", "cpu"})
    finished = []
    finish = utils.DeferredStopCheck.finish
    monkeypatch.setattr(utils.DeferredStopCheck, "finish", lambda self: finished.append(finish(self)) or finished[-1])
    model = tiny_model("llama")
    ids, mask = _prompts()
    plain = _greedy(model, ids, mask, new=8)
    eos = int(plain[0, ids.shape[1] + 2]) if stop_early else None  # row 0 stops after three tokens, row 1 too
    options = dict(max_new_tokens=8, do_sample=sample, top_k=0, pad_token_id=0, eos_token_id=eos)
    torch.manual_seed(3)
    expected = model.generate(input_ids=ids, attention_mask=mask, **options)
    assert not finished  # transformers' own generate on a CPU: a check per step
    generation.enable(model)
    torch.manual_seed(3)
    out = model.generate(input_ids=ids, attention_mask=mask, **options)
    assert torch.equal(out, expected)
    assert (out.shape[1] < ids.shape[1] + 8) == stop_early  # every row stopped early: that was seen a step late
    assert finished == [1 if stop_early else 0]  # ... and the step past the stop undone
