"""fast_inference=True without vLLM: `model.fast_generate` / `load_lora` / `SamplingParams` as the GRPO
notebooks call them, answered by our generation path, against transformers' own generate."""

from __future__ import annotations

import types

import pytest
import torch

from tiny_notebook_models import write_model

pytestmark = pytest.mark.slow  # a tiny model decoding on the CPU

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from unsloth import FastLanguageModel

    # The mechanics are under test, not the kernels; the setting must not outlive this module's tests.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("UNSLOTH_KERNELS", "0")
        yield _load(tmp_path_factory, FastLanguageModel)


def _load(tmp_path_factory, FastLanguageModel):
    folder = write_model(tmp_path_factory.mktemp("m") / "Llama-3.2-1B-Instruct", "llama")
    model, tokenizer = FastLanguageModel.from_pretrained(model_name=folder, max_seq_length=64, load_in_4bit=False,
                                                         fast_inference=True, max_lora_rank=8,
                                                         gpu_memory_utilization=0.5)
    model = FastLanguageModel.get_peft_model(model, r=8, lora_alpha=8, target_modules=TARGETS, random_state=0)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # adapters that change the tokens (peft starts B at zero)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return model, tokenizer


PROMPTS = ["What is 2 + 2?", "Name the capital of France. Think step by step.", "Say hello."]


def _direct(model, tokenizer, prompts, **options):
    """transformers' generate on the same left-padded batch (what fast_generate must equal)."""
    tokenizer.padding_side = "left"
    try:
        batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tokenizer.padding_side = "right"
    with torch.no_grad():
        out = model.generate(**batch, pad_token_id=tokenizer.pad_token_id, **options)
    return out[:, batch["input_ids"].shape[1]:].tolist()


def _until_eos(row, eos):
    return row[:row.index(eos) + 1] if eos in row else row


def test_fast_generate_is_the_base_models_greedy_batch_and_keeps_the_trained_adapters(loaded):
    from unsloth import SamplingParams

    model, tokenizer = loaded
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    outputs = model.fast_generate(PROMPTS, sampling_params=SamplingParams(temperature=0, max_tokens=6),
                                  lora_request=None)
    with model.disable_adapter():
        expected = _direct(model, tokenizer, PROMPTS, max_new_tokens=6, do_sample=False)
    eos = tokenizer.eos_token_id
    assert [o.outputs[0].token_ids for o in outputs] == [_until_eos(row, eos) for row in expected]
    assert [o.prompt for o in outputs] == PROMPTS
    for out in outputs:
        completion = out.outputs[0]
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        assert completion.finish_reason == ("stop" if completion.token_ids[-1] == eos else "length")
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if "lora_" in n)
    from unsloth.models import generation

    assert generation.enabled(model)  # it ran on our static-cache path, which stays on for the next call


def test_a_lora_request_answers_with_the_saved_adapters_and_puts_the_trained_ones_back(loaded, tmp_path):
    model, tokenizer = loaded
    greedy = {"temperature": 0, "max_tokens": 5}
    saved_answer = _direct(model, tokenizer, PROMPTS[:1], max_new_tokens=5, do_sample=False)[0]
    model.save_lora(str(tmp_path / "grpo_saved_lora"))
    request = model.load_lora(str(tmp_path / "grpo_saved_lora"))
    assert request.lora_path == str(tmp_path / "grpo_saved_lora") and request.lora_int_id >= 1
    trained = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}
    with torch.no_grad():  # training moves on: the live adapters are no longer the saved ones
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(-1.0)
    moved = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}
    out = model.fast_generate(PROMPTS[0], sampling_params=greedy, lora_request=request)[0].outputs[0]
    assert out.token_ids == _until_eos(saved_answer, tokenizer.eos_token_id)
    assert all(torch.equal(p, moved[n]) for n, p in model.named_parameters() if "lora_B" in n)
    # vLLM's own LoRARequest names only the folder: the tensors are read from it
    vllm_request = types.SimpleNamespace(lora_name="x", lora_int_id=9, lora_path=request.lora_path)
    again = model.fast_generate([PROMPTS[0]], sampling_params=greedy, lora_request=vllm_request)[0].outputs[0]
    assert again.token_ids == out.token_ids
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(trained[name])


def test_sampling_n_seed_stop_strings_and_ignore_eos(loaded):
    from unsloth import SamplingParams

    model, tokenizer = loaded
    params = SamplingParams(n=3, temperature=1.0, top_k=50, seed=7, max_tokens=6)
    first = model.fast_generate(PROMPTS[:2], sampling_params=params)
    second = model.fast_generate(PROMPTS[:2], sampling_params=params)
    assert [len(o.outputs) for o in first] == [3, 3]
    assert [[c.token_ids for c in o.outputs] for o in first] == [[c.token_ids for c in o.outputs] for o in second]
    assert len({tuple(c.token_ids) for o in first for c in o.outputs}) > 1  # sampled, not one answer repeated
    long = model.fast_generate(PROMPTS[0], sampling_params=SamplingParams(temperature=0, ignore_eos=True,
                                                                          max_tokens=8))[0].outputs[0]
    assert len(long.token_ids) == 8 and long.finish_reason == "length"
    # a stop string cut out of the text (kept with include_stop_str_in_output), as vLLM reports it
    text = long.text
    stop = tokenizer.decode(long.token_ids[4:5])
    assert stop.strip() and stop in text
    cut = model.fast_generate(PROMPTS[0], sampling_params=SamplingParams(
        temperature=0, ignore_eos=True, max_tokens=8, stop=[stop]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop and cut.text == text[:text.find(stop)]
    assert len(cut.token_ids) <= 5  # decoding stopped there
    kept = model.fast_generate(PROMPTS[0], sampling_params=SamplingParams(
        temperature=0, ignore_eos=True, max_tokens=8, stop=[stop], include_stop_str_in_output=True))
    assert kept[0].outputs[0].text == text[:text.find(stop) + len(stop)]
    # greedy n > 1 gives n copies of the one greedy answer, as vLLM does
    copies = model.fast_generate(PROMPTS[0], sampling_params=SamplingParams(temperature=0, n=2, max_tokens=4))
    assert copies[0].outputs[0].token_ids == copies[0].outputs[1].token_ids


def test_the_mode_and_use_cache_are_put_back(loaded):
    model, _ = loaded
    model.train()
    model.config.use_cache = False
    model.fast_generate("Say hello.", sampling_params={"temperature": 0, "max_tokens": 2})
    assert model.training and model.config.use_cache is False


def test_bad_requests_are_refused_naming_the_fix(loaded, tmp_path):
    from unsloth.errors import UsageError

    model, _ = loaded
    with pytest.raises(UsageError, match="adapter_model.safetensors"):
        model.load_lora(str(tmp_path / "missing"))
    with pytest.raises(UsageError, match="prompt must be a string"):
        model.fast_generate([["What", "is"]])
    with pytest.raises(UsageError, match="frequency_penalty"):
        model.fast_generate("Say hello.", sampling_params={"frequency_penalty": 0.2})


def test_grpo_config_takes_vllm_sampling_params_onto_trls_fields():
    from unsloth import FastLanguageModel, SamplingParams  # noqa: F401  (first, as in the notebooks)
    from trl import GRPOConfig

    params = SamplingParams(min_p=0.1, top_p=1.0, top_k=-1, seed=3407, stop=["<|end_of_text|>"],
                            include_stop_str_in_output=True)
    config = GRPOConfig(vllm_sampling_params=params, temperature=0.9, output_dir="unused", use_cpu=True,
                        per_device_train_batch_size=4, num_generations=4, max_completion_length=8)
    assert config.min_p == 0.1 and config.top_p == 1.0 and config.top_k == 0
    assert config.temperature == 0.9  # the config's own setting wins
    assert config.generation_kwargs == {"stop_strings": ["<|end_of_text|>"]}  # no vLLM: transformers' name
    assert config._unsloth_use_vllm_given is False


def test_a_fast_inference_models_grpo_uses_vllm_only_where_it_runs_and_the_config_did_not_choose(loaded,
                                                                                                 monkeypatch):
    from unsloth.training import trl_compat

    model, _ = loaded
    assert model._unsloth_fast_inference
    for usable, given, expected in ((True, False, True), (False, False, False), (True, True, False)):
        monkeypatch.setattr("unsloth.models.loader.vllm_usable", lambda m, usable=usable: usable)
        args = types.SimpleNamespace(use_vllm=False, _unsloth_use_vllm_given=given)
        trl_compat.grpo_rollouts(model, args)
        assert args.use_vllm is expected, (usable, given)
