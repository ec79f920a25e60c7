"""FastModel on vision-language checkpoints, as the Gemma 3 / 3n / 4 notebooks run it, on tiny random models.

Text-only notebooks (Gemma3_(4B), Gemma3N_(4B)-Conversational, Gemma4_(E4B)-Text): FastModel ->
(model, processor) -> get_peft_model(finetune_*) -> get_chat_template on the processor ->
standardize_data_formats -> text without its <bos> -> SFTTrainer(tokenizer=processor,
dataset_text_field="text") -> train_on_responses_only(trainer) -> the notebook's decode of the masked
labels -> train (loss falls) -> generate from processor.apply_chat_template(..., return_dict=True).
Image notebooks through FastModel: the vision tower adapted, UnslothVisionDataCollator, a few steps,
generate on processor(image, text).
"""

from __future__ import annotations

import pytest
import torch

from tiny_notebook_models import losses_of
from tiny_vision import (VISION_FAMILIES, add_audio_tower, build_processor, build_tokenizer, images, save_tiny_vision,
                         vision_config)

pytest.importorskip("PIL")


@pytest.fixture
def one_thread(monkeypatch):
    monkeypatch.setenv("UNSLOTH_KERNELS", "0")  # the cells are under test here; the kernels are covered elsewhere
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: more threads only contend on a shared machine
    yield
    torch.set_num_threads(threads)


def _load(folder, **options):
    from unsloth import FastModel

    return FastModel.from_pretrained(model_name=str(folder), max_seq_length=128, load_in_4bit=False,
                                     load_in_8bit=False, full_finetuning=False, **options)


def _gemma4_processor():
    """The tiny Gemma 4 processor over a tokenizer that also has Gemma 4's turn markers, as its vocabulary does."""
    tokenizer = build_tokenizer("gemma4")
    tokenizer.add_tokens(["<|turn>", "<turn|>"], special_tokens=True)
    return build_processor("gemma4", tokenizer=tokenizer)


def _save(family: str, folder, audio: bool = False) -> str:
    """A tiny random model of `family` and its processor in `folder`; Gemma 4 with its turn markers
    (and, with `audio`, an audio tower as E2B / E4B ship)."""
    from transformers import AutoModelForImageTextToText

    if family != "gemma4":
        return save_tiny_vision(family, folder)
    processor = _gemma4_processor()
    config = vision_config(family, processor.tokenizer)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(add_audio_tower(config, processor.tokenizer) if audio else config)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return str(folder)


def _adapted_parts(model) -> set[str]:
    """The top-level parts of the (peft-wrapped) model that hold trainable weights: language_model, vision_tower..."""
    return {n.split(".")[3] for n, p in model.named_parameters() if p.requires_grad}  # base_model.model.model.*


def test_fastmodel_returns_a_processor_for_vision_models_and_a_tokenizer_for_text_models(tmp_path, one_thread):
    from transformers import PreTrainedTokenizerBase
    from transformers.processing_utils import ProcessorMixin

    from tiny_notebook_models import write_model
    from unsloth import FastModel
    from unsloth.models.vision import is_vision_language

    model, processor = _load(save_tiny_vision("gemma3", tmp_path / "gemma-3-4b-it"))
    assert isinstance(processor, ProcessorMixin) and type(model).__name__ == "Gemma3ForConditionalGeneration"
    # what notebooks read off the `tokenizer` they were handed, answered by the processor's tokenizer
    assert (processor.pad_token, processor.eos_token_id) == (processor.tokenizer.pad_token,
                                                              processor.tokenizer.eos_token_id)
    with pytest.raises(AttributeError, match="no attribute 'no_such_thing'"):
        processor.no_such_thing
    processor.save_pretrained(tmp_path / "saved")  # under its own class name: transformers loads it back
    assert type(ProcessorMixin.get_processor_dict(str(tmp_path / "saved"))[0]["processor_class"]) is str

    peft = FastModel.get_peft_model(model, finetune_vision_layers=False, finetune_language_layers=True,
                                    finetune_attention_modules=True, finetune_mlp_modules=True, r=4, lora_alpha=4)
    assert _adapted_parts(peft) == {"language_model"}
    model, _ = _load(tmp_path / "gemma-3-4b-it")
    assert _adapted_parts(FastModel.get_peft_model(model, r=4)) == {"language_model", "vision_tower"}  # as Unsloth

    for family in VISION_FAMILIES:  # Qwen2.5-VL, Qwen3-VL, Llama 3.2 Vision too: read off their configs
        vision_config(family, build_tokenizer(family)).save_pretrained(tmp_path / "configs" / family)
        assert is_vision_language(str(tmp_path / "configs" / family)), family

    # a causal LM keeps FastLanguageModel's route and its tokenizer; the audio switch is taken and changes nothing
    text = write_model(tmp_path / "Llama-3.2-1B", "llama")
    assert not is_vision_language(text) and not is_vision_language(str(tmp_path / "missing"))
    model, tokenizer = _load(text)
    assert isinstance(tokenizer, PreTrainedTokenizerBase)
    peft = FastModel.get_peft_model(model, finetune_vision_layers=False, finetune_audio_layers=True, r=4)
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, p in peft.named_parameters() if p.requires_grad} \
        >= {"q_proj", "down_proj"}


@pytest.mark.slow
def test_saved_adapters_of_a_vision_model_load_back_with_the_processor(tmp_path, one_thread):
    """The notebooks' reload cell, `FastModel.from_pretrained("gemma_3_lora")` on the folder they saved
    the adapters and processor into: routed by the base model's config, the same model and a processor."""
    from transformers.processing_utils import ProcessorMixin

    from unsloth import FastModel

    model, processor = _load(save_tiny_vision("gemma3", tmp_path / "gemma-3-4b-it"))
    model = FastModel.get_peft_model(model, finetune_vision_layers=False, r=4, lora_alpha=4,
                                     init_lora_weights=False)  # adapters that change the logits
    model.save_pretrained(tmp_path / "gemma_3_lora")
    processor.save_pretrained(tmp_path / "gemma_3_lora")
    reloaded, again = _load(tmp_path / "gemma_3_lora")
    assert isinstance(again, ProcessorMixin) and hasattr(reloaded, "peft_config")
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_an_audio_text_checkpoint_loads_as_vision_language_with_its_audio_tower_adaptable(tmp_path, one_thread):
    """Gemma 4 E2B / E4B (the Audio notebooks): an audio tower beside the vision tower; FastModel loads the
    whole model and its processor, and finetune_audio_layers puts LoRA into the audio tower."""
    from transformers.processing_utils import ProcessorMixin

    from unsloth import FastModel

    model, processor = _load(_save("gemma4", tmp_path / "gemma-4-E2B-it", audio=True))
    assert isinstance(processor, ProcessorMixin) and processor.feature_extractor is not None
    peft = FastModel.get_peft_model(model, finetune_vision_layers=False, finetune_audio_layers=True, r=4)
    assert _adapted_parts(peft) == {"language_model", "audio_tower", "embed_audio"}


def test_get_chat_template_on_a_processor_sets_both_templates_and_the_tokenizers_eos():
    """Gemma 4's turns (`<|turn>role ... <turn|>`, a system turn of its own, an image as its placeholder)
    on the processor, whose tokenizer's EOS becomes the end of a turn."""
    from unsloth.chat_templates import get_chat_template

    processor = get_chat_template(_gemma4_processor(), chat_template="gemma-4")
    assert processor.chat_template == processor.tokenizer.chat_template and processor.tokenizer.eos_token == "<turn|>"
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "t5 t6"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "t7"}]}]
    assert processor.apply_chat_template(messages, tokenize=False) == (
        "<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\n<|image|>t5 t6<turn|>\n<|turn>model\nt7<turn|>\n")
    assert processor.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=True).endswith(
        "<turn|>\n<|turn>model\n")


# family -> (the notebook's template name, the first row's text as the notebook renders it)
TEXT_NOTEBOOKS = {
    "gemma3": ("gemma-3", "<start_of_turn>user\nt5 t6 t7<end_of_turn>\n<start_of_turn>model\nt20 t21 t22<end_of_turn>\n"),
    "gemma4": ("gemma-4", "<|turn>user\nt5 t6 t7<turn|>\n<|turn>model\nt20 t21 t22<turn|>\n"),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(TEXT_NOTEBOOKS))
def test_the_text_notebook_runs_on_a_vision_model_and_its_processor(family, tmp_path, one_thread):
    from datasets import Dataset
    from transformers import TextStreamer
    from transformers.processing_utils import ProcessorMixin
    from trl import SFTConfig, SFTTrainer

    from unsloth import FastModel
    from unsloth.chat_templates import get_chat_template, standardize_data_formats, train_on_responses_only

    template, first_text = TEXT_NOTEBOOKS[family]
    model, tokenizer = _load(_save(family, tmp_path / family))
    assert isinstance(tokenizer, ProcessorMixin)
    model = FastModel.get_peft_model(model, finetune_vision_layers=False, finetune_language_layers=True,
                                     finetune_attention_modules=True, finetune_mlp_modules=True, r=8, lora_alpha=8,
                                     lora_dropout=0, bias="none", random_state=3407)
    tokenizer = get_chat_template(tokenizer, chat_template=template)
    rows = [{"conversations": [{"from": "human", "value": f"t{5 + i % 4} t6 t7"},
                               {"from": "gpt", "value": f"t{20 + i % 4} t21 t22"}]} for i in range(8)]
    dataset = standardize_data_formats(Dataset.from_list(rows))

    def formatting_prompts_func(examples):
        convos = examples["conversations"]
        texts = [tokenizer.apply_chat_template(convo, tokenize=False, add_generation_prompt=False)
                 .removeprefix("<bos>") for convo in convos]
        return {"text": texts}

    dataset = dataset.map(formatting_prompts_func, batched=True)
    assert dataset[0]["text"] == first_text
    trainer = SFTTrainer(model=model, tokenizer=tokenizer, train_dataset=dataset, eval_dataset=None,
                         args=SFTConfig(dataset_text_field="text", per_device_train_batch_size=2,
                                        gradient_accumulation_steps=1, warmup_steps=1, max_steps=6,
                                        learning_rate=2e-2, logging_steps=1, optim="adamw_torch", weight_decay=0.001,
                                        lr_scheduler_type="linear", seed=3407, report_to="none",
                                        output_dir=str(tmp_path / "outputs")))
    trainer = train_on_responses_only(trainer)  # the markers read off the processor's template
    kept = tokenizer.decode([tokenizer.pad_token_id if x == -100 else x for x in trainer.train_dataset[0]["labels"]]
                            ).replace(tokenizer.pad_token, " ")
    assert kept.split() and kept.split()[:3] == ["t20", "t21", "t22"] and "user" not in kept, kept
    trainer.train()
    losses = losses_of(trainer)
    assert losses[-1] < losses[0] - 0.3, losses

    messages = [{"role": "user", "content": [{"type": "text", "text": "t5 t6 t7"}]}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", tokenize=True,
                                           return_dict=True).to("cpu")
    assert tokenizer.decode(inputs["input_ids"][0]).split()[-1] == "model"  # the generation prompt: a model turn
    streamed = []

    class Capture(TextStreamer):
        def on_finalized_text(self, text, stream_end=False):
            streamed.append(text)

    outputs = model.generate(**inputs, max_new_tokens=6, do_sample=False, streamer=Capture(tokenizer, skip_prompt=True))
    assert outputs.shape[1] > inputs["input_ids"].shape[1] and "".join(streamed)
    assert tokenizer.batch_decode(outputs)[0].startswith(tokenizer.decode(inputs["input_ids"][0]))


@pytest.mark.slow
def test_the_image_notebook_runs_through_fastmodel(tmp_path, one_thread):
    from trl import SFTConfig, SFTTrainer

    from unsloth import FastModel
    from unsloth.trainer import UnslothVisionDataCollator

    model, processor = _load(_save("gemma4", tmp_path / "gemma-4-E4B-it"))
    model = FastModel.get_peft_model(model, finetune_vision_layers=True, finetune_language_layers=True,
                                     finetune_attention_modules=True, finetune_mlp_modules=True, r=8, lora_alpha=16,
                                     lora_dropout=0, bias="none", random_state=3407, target_modules="all-linear")
    assert {"language_model", "vision_tower"} <= _adapted_parts(model)
    pictures = images(4)
    data = [{"messages": [
        {"role": "user", "content": [{"type": "text", "text": "t5"}, {"type": "image", "image": pictures[i]}]},
        {"role": "assistant", "content": [{"type": "text", "text": f"t{20 + i} t{30 + i}"}]}]} for i in range(4)]
    FastModel.for_training(model)
    trainer = SFTTrainer(model=model, train_dataset=data, processing_class=processor.tokenizer,
                         data_collator=UnslothVisionDataCollator(model, processor),
                         args=SFTConfig(per_device_train_batch_size=2, max_steps=6, learning_rate=1e-2,
                                        logging_steps=1, report_to="none", output_dir=str(tmp_path / "out"),
                                        remove_unused_columns=False, dataset_text_field="",
                                        dataset_kwargs={"skip_prepare_dataset": True}, max_length=512,
                                        save_strategy="no", seed=0))
    trainer.train()
    losses = losses_of(trainer)
    assert losses[-1] < losses[0], losses

    FastModel.for_inference(model)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "t5"}]}]
    input_text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(pictures[0], input_text, add_special_tokens=False, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=4, use_cache=True, do_sample=False)
    assert out.shape[1] > inputs["input_ids"].shape[1]
