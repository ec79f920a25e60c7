"""Gemma 3n (the Gemma3N_(4B) notebooks) on tiny random models.

Its vision tower is a timm MobileNetV5, and timm needs a torchvision built for the installed torch,
which this machine's CPU torch has none of: the whole Gemma3nForConditionalGeneration is refused
clearly where timm is missing. Its language model (AltUp, LAuReL, per-layer inputs, shared KV,
activation sparsity) loads, adapts, trains and generates through our loader as Gemma3nForCausalLM.
"""

from __future__ import annotations

import json

import pytest
import torch

from tiny_vision import build_tokenizer, gemma3n_config, save_tiny_gemma3n_text


def _load(folder):
    from unsloth import FastModel

    return FastModel.from_pretrained(model_name=str(folder), max_seq_length=64, load_in_4bit=False)


@pytest.mark.parametrize("labels_saved", [True, False])
def test_the_whole_model_is_refused_clearly_where_timm_is_missing(labels_saved, tmp_path):
    """Before any weight is read; also where the config itself cannot be read without timm (a vision
    config with no label names, which transformers fills in from timm's ImageNet labels)."""
    from transformers.utils import is_timm_available

    from unsloth.errors import UnslothError

    if is_timm_available():
        pytest.skip("timm is installed: transformers builds the MobileNetV5 tower")
    tokenizer = build_tokenizer("gemma3n")
    gemma3n_config(tokenizer).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    if not labels_saved:
        config = json.loads((tmp_path / "config.json").read_text())
        config["vision_config"].pop("label_names")
        (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnslothError, match="vision tower is a timm model") as refused:
        _load(tmp_path)
    assert "pip install timm" in refused.value.fix and "torchvision" in refused.value.fix


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True, "unsloth"])
def test_our_patches_and_checkpointing_keep_the_loss_and_gradients(checkpointing, one_thread):
    """Against the stock model. Checkpointed, the layers that store the KV states the last layers share
    keep their graph (a no-grad first pass would cut the shared layers' gradients to them)."""
    import copy

    from peft import LoraConfig, get_peft_model

    from tiny_vision import gemma3n_text_config
    from transformers import AutoModelForCausalLM
    from unsloth.models.checkpointing import apply_gradient_checkpointing
    from unsloth.models.patches import patch_model, patch_peft_model

    tokenizer = build_tokenizer("gemma3n")
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(gemma3n_text_config(tokenizer), dtype=torch.float32)
    patched = copy.deepcopy(reference)
    report = patch_model(patched)
    assert report.rms_norm > 0 and report.mlp == 3 and report.loss  # layer 0's top-k MLP stays stock
    lora = LoraConfig(r=4, lora_alpha=4, init_lora_weights=False,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    reference, patched = get_peft_model(reference, lora), get_peft_model(patched, copy.deepcopy(lora))
    patched.load_state_dict(reference.state_dict())
    patch_peft_model(patched)
    assert apply_gradient_checkpointing(patched.get_base_model(), checkpointing) == (4 if checkpointing else 0)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, len(tokenizer), (2, 12), generator=g)
    labels = ids.clone()
    labels[:, :4] = -100
    grads = []
    for model in (reference, patched):
        model.train()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        grads.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    (ref_loss, ref_grads), (loss, fast_grads) = grads
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert ref_grads.keys() == fast_grads.keys() and ref_grads
    for name, grad in ref_grads.items():
        torch.testing.assert_close(fast_grads[name], grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def _trained_names(model) -> set[str]:
    return {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, p in model.named_parameters() if p.requires_grad}


def test_the_language_model_loads_and_the_finetune_switches_pick_its_modules(tmp_path, one_thread):
    from transformers import PreTrainedTokenizerBase

    from unsloth import FastModel

    folder = save_tiny_gemma3n_text(tmp_path / "gemma-3n-text")
    for attention, mlp, expected in ((True, False, {"q_proj", "k_proj", "v_proj", "o_proj"}),
                                     (False, True, {"gate_proj", "up_proj", "down_proj"})):
        model, tokenizer = _load(folder)
        assert type(model).__name__ == "Gemma3nForCausalLM" and isinstance(tokenizer, PreTrainedTokenizerBase)
        peft = FastModel.get_peft_model(model, finetune_vision_layers=True, finetune_audio_layers=True,
                                        finetune_language_layers=True, finetune_attention_modules=attention,
                                        finetune_mlp_modules=mlp, r=4, lora_alpha=4)
        # AltUp's and LAuReL's projections and the per-layer gates stay frozen, as in Unsloth
        assert _trained_names(peft) == expected
    with pytest.raises(ValueError, match="finetune_language_layers=False"):
        FastModel.get_peft_model(_load(folder)[0], finetune_language_layers=False, r=4)


@pytest.mark.slow
def test_the_conversational_notebook_trains_and_generates_on_the_language_model(tmp_path, one_thread, monkeypatch):
    """Gemma3N_(4B)-Conversational's cells on the language model: the "gemma-3n" template, SFTTrainer
    on the rendered text, train_on_responses_only, falling loss, then generate from the chat template."""
    from unsloth import FastModel  # first, as in the notebooks: TRL's trainers then take what they pass
    from unsloth.chat_templates import get_chat_template, standardize_data_formats, train_on_responses_only

    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    monkeypatch.setenv("UNSLOTH_KERNELS", "0")  # the cells are under test here; the kernels just above
    model, tokenizer = _load(save_tiny_gemma3n_text(tmp_path / "gemma-3n-text"))
    model = FastModel.get_peft_model(model, finetune_vision_layers=False, finetune_language_layers=True,
                                     finetune_attention_modules=True, finetune_mlp_modules=True, r=8, lora_alpha=8,
                                     lora_dropout=0, bias="none", random_state=3407)
    tokenizer = get_chat_template(tokenizer, chat_template="gemma-3n")
    rows = [{"conversations": [{"from": "human", "value": f"t{5 + i % 4} t6 t7"},
                               {"from": "gpt", "value": f"t{20 + i % 4} t21 t22"}]} for i in range(8)]
    dataset = standardize_data_formats(Dataset.from_list(rows)).map(lambda examples: {"text": [
        tokenizer.apply_chat_template(c, tokenize=False).removeprefix("<bos>") for c in examples["conversations"]]},
        batched=True)
    assert dataset[0]["text"] == "<start_of_turn>user\nt5 t6 t7<end_of_turn>\n<start_of_turn>model\nt20 t21 t22<end_of_turn>\n"
    trainer = SFTTrainer(model=model, tokenizer=tokenizer, train_dataset=dataset,
                         args=SFTConfig(dataset_text_field="text", per_device_train_batch_size=4, max_steps=8,
                                        learning_rate=2e-2, logging_steps=1, optim="adamw_torch", seed=3407,
                                        report_to="none", output_dir=str(tmp_path / "outputs")))
    trainer = train_on_responses_only(trainer, instruction_part="<start_of_turn>user\n",
                                      response_part="<start_of_turn>model\n")
    labels = [x for x in trainer.train_dataset[0]["labels"] if x != -100]
    assert tokenizer.decode(labels).split()[:3] == ["t20", "t21", "t22"]
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert sum(losses[-2:]) < sum(losses[:2]), losses

    FastModel.for_inference(model)
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": "t5 t6 t7"}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).split()
    assert answer and set(answer) <= {"t20", "t21", "t22", "t23"}, answer  # the responses' words, learnt
