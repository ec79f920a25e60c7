"""The notebook API without training: TRL keyword mapping, configs, templates and dataset helpers (seconds)."""

from __future__ import annotations

import inspect
import logging

import pytest

from tiny_notebook_models import make_tokenizer, sharegpt_rows


@pytest.fixture(scope="module")
def trl():
    import trl

    import unsloth

    unsloth.FastLanguageModel  # noqa: B018  (first use installs the TRL compatibility)
    return trl


def test_configs_take_legacy_and_retired_arguments(trl, caplog):
    with caplog.at_level(logging.WARNING, logger="unsloth"):
        config = trl.SFTConfig(output_dir="o", max_seq_length=77, evaluation_strategy="no", warmup_ratio=0.1,
                               overwrite_output_dir=True, logging_dir="logs")
    # Each value lands where the installed transformers reads it (both ends of the supported window).
    from transformers import TrainingArguments

    fields = TrainingArguments.__dataclass_fields__
    assert (config.max_length, config.eval_strategy) == (77, "no")
    assert (config.warmup_ratio if "warmup_ratio" in fields else config.warmup_steps) == 0.1
    assert config.bf16 is False and config.fp16 is False  # no bf16 here: the CPU starts
    warnings = [r.getMessage() for r in caplog.records if "retired" in r.getMessage()]
    retired = [name for name in ("overwrite_output_dir", "logging_dir") if name not in fields]
    assert len(warnings) == (1 if retired else 0) and all(name in warnings[0] for name in retired)


def test_dataset_kwargs_trl_no_longer_reads_are_dropped_with_one_warning(trl, caplog):
    # what older notebooks pass; current TRL reads only skip_prepare_dataset from it
    with caplog.at_level(logging.WARNING, logger="unsloth"):
        config = trl.SFTConfig(output_dir="o", dataset_kwargs={"add_special_tokens": False, "append_concat_token": False,
                                                               "skip_prepare_dataset": True})
    assert config.dataset_kwargs == {"skip_prepare_dataset": True}
    warnings = [r.getMessage() for r in caplog.records if "dataset_kwargs" in r.getMessage()]
    assert len(warnings) == 1 and "add_special_tokens" in warnings[0] and "append_concat_token" in warnings[0]


def test_unknown_and_doubled_keywords_are_clear_errors(trl):
    from unsloth.training.trl_compat import CompatError

    with pytest.raises(CompatError, match="learnin_rate.*\n.*did you mean 'learning_rate'"):
        trl.SFTConfig(output_dir="o", learnin_rate=1e-4)
    with pytest.raises(CompatError, match="same setting"):
        trl.SFTConfig(output_dir="o", max_seq_length=8, max_length=16)
    from transformers import TrainingArguments

    if "warmup_ratio" not in TrainingArguments.__dataclass_fields__:  # transformers 5: one field for both
        with pytest.raises(CompatError, match="both set"):
            trl.GRPOConfig(output_dir="o", warmup_ratio=0.1, warmup_steps=5)


def test_grpo_batch_is_raised_to_whole_groups(trl):
    config = trl.GRPOConfig(output_dir="o", per_device_train_batch_size=1, gradient_accumulation_steps=1,
                            num_generations=8, max_prompt_length=256, max_completion_length=16)
    assert config.generation_batch_size == 8 and config.generation_batch_size % config.num_generations == 0
    assert trl.GRPOConfig(output_dir="o", per_device_train_batch_size=4, num_generations=4,
                          gradient_accumulation_steps=1).generation_batch_size == 4


def test_a_plain_training_arguments_is_promoted_with_the_trainer_level_options(trl):
    from transformers import TrainingArguments

    from unsloth.training.trl_compat import normalize_trainer_kwargs

    args = TrainingArguments(output_dir="o", learning_rate=3e-4, max_steps=5)
    out = normalize_trainer_kwargs(trl.SFTTrainer.__mro__[1], trl.SFTConfig, args,
                                   {"tokenizer": "T", "dataset_text_field": "body", "max_seq_length": 99,
                                    "packing": True, "dataset_num_proc": 1})
    assert out["processing_class"] == "T" and "tokenizer" not in out
    config = out["args"]
    assert isinstance(config, trl.SFTConfig)
    assert (config.learning_rate, config.max_steps, config.dataset_text_field, config.max_length, config.packing) \
        == (3e-4, 5, "body", 99, True)


def test_orpo_is_importable_from_trl(trl):
    from trl import ORPOConfig, ORPOTrainer  # noqa: F401  (moved to trl.experimental upstream)


@pytest.mark.parametrize("name", ["chatml", "qwen-2.5", "qwen3", "qwen3-instruct", "qwen3-thinking", "llama-3",
                                  "llama-3.1", "llama-3.2", "gemma-3", "gemma3n", "gemma-4", "mistral", "phi-4", "zephyr",
                                  "alpaca", "vicuna"])
def test_every_named_template_renders_a_conversation(name):
    from unsloth.chat_templates import get_chat_template

    tokenizer = get_chat_template(make_tokenizer("llama"), chat_template=name)
    text = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Hi there"},
                                          {"role": "assistant", "content": "Hello"}], tokenize=False)
    assert "Hi there" in text and "Hello" in text


CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello"}]
# What the released models' own chat templates render for CONVERSATION (and, second, for its user turn
# with the generation prompt), on a tokenizer of that family.
OWN_RENDERING = {
    ("chatml", "qwen2"): ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
                          "<|im_start|>assistant\nHello<|im_end|>\n",
                          "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"),
    ("qwen-2.5", "qwen2"): ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
                            "<|im_start|>assistant\nHello<|im_end|>\n",
                            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                            "<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"),
    ("gemma-3", "gemma3_text"): ("<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\n"
                                 "Hello<end_of_turn>\n",
                                 "<bos><start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n"),
    ("llama-3", "llama"): ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                           "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
                           "<|start_header_id|>assistant<|end_header_id|>\n\nHello<|eot_id|>",
                           "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
                           "<|start_header_id|>assistant<|end_header_id|>\n\n"),
}


@pytest.mark.parametrize(("name", "family"), sorted(OWN_RENDERING))
def test_templates_render_the_models_own_text_and_tokens(name, family):
    from unsloth.chat_templates import get_chat_template

    tokenizer = get_chat_template(make_tokenizer(family), chat_template=name)
    conversation, prompt = OWN_RENDERING[(name, family)]
    assert tokenizer.apply_chat_template(CONVERSATION, tokenize=False) == conversation
    assert tokenizer.apply_chat_template(CONVERSATION[1:2], tokenize=False, add_generation_prompt=True) == prompt
    ids = tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)["input_ids"]
    assert list(ids) == tokenizer(conversation, add_special_tokens=False)["input_ids"]  # one BOS, from the text


def test_gemma3_renders_content_lists_as_text_not_a_repr():
    from unsloth.chat_templates import get_chat_template

    tokenizer = get_chat_template(make_tokenizer("gemma3_text"), chat_template="gemma-3")
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
         {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
         {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]}], tokenize=False)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                    "<start_of_turn>model\nHello<end_of_turn>\n")


def test_qwen3_modes():
    from unsloth.chat_templates import get_chat_template

    user = [{"role": "user", "content": "2+2?"}]
    tok = get_chat_template(make_tokenizer("qwen3"), chat_template="qwen3")
    assert tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True, enable_thinking=False) \
        == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    tok = get_chat_template(make_tokenizer("qwen3"), chat_template="qwen3-thinking")
    assert tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True).endswith(
        "<|im_start|>assistant\n<think>\n")
    assert tok.eos_token == "<|im_end|>"  # map_eos_token: generation stops at the end of the turn


def test_mapping_and_map_eos_token_on_a_tokenizer_without_chatml_tokens():
    from unsloth.chat_templates import get_chat_template

    tokenizer = get_chat_template(make_tokenizer("mistral"), chat_template="chatml", map_eos_token=True,
                                  mapping={"role": "from", "content": "value", "user": "human", "assistant": "gpt"})
    text = tokenizer.apply_chat_template(sharegpt_rows(1)[0]["conversations"], tokenize=False)
    assert text == "<|im_start|>user\nName the capital of France.</s>\n<|im_start|>assistant\nParis.</s>\n"


def test_dataset_helpers():
    from datasets import Dataset

    from unsloth import standardize_sharegpt, to_sharegpt
    from unsloth.chat_templates import apply_chat_template, standardize_data_formats

    data = standardize_sharegpt(Dataset.from_list(sharegpt_rows(2)))
    assert data[0]["conversations"][1] == {"role": "assistant", "content": "Paris."} and "source" in data.column_names
    assert standardize_data_formats(Dataset.from_list(sharegpt_rows(2)))[0]["conversations"] == data[0]["conversations"]
    rows = Dataset.from_list([{"instruction": "Add", "input": "1 and 2", "output": "3"},
                              {"instruction": "Greet", "input": "", "output": "Hi"}])
    shared = to_sharegpt(rows, merged_prompt="{instruction}[[\nYour input is:\n{input}]]", output_column_name="output")
    assert shared[0]["conversations"][0]["value"] == "Add\nYour input is:\n1 and 2"
    assert shared[1]["conversations"][0]["value"] == "Greet"
    assert len(to_sharegpt(rows, merged_prompt="{instruction}", conversation_extension=2)[0]["conversations"]) == 4
    tokenizer = make_tokenizer("llama")
    texts = apply_chat_template(shared, tokenizer=tokenizer, chat_template="### Q:\n{INPUT}\n### A:\n{OUTPUT}",
                                default_system_message=None)
    assert texts[1]["text"] == "### Q:\nGreet\n### A:\nHi<|end_of_text|>"


def test_response_markers_are_read_off_the_template():
    from unsloth.chat_templates import get_chat_template
    from unsloth.training.chat_templates import response_markers

    expected = {"llama-3.1": ("<|start_header_id|>user<|end_header_id|>\n\n",
                              "<|start_header_id|>assistant<|end_header_id|>\n\n"),
                "chatml": ("<|im_start|>user\n", "<|im_start|>assistant\n"),
                "gemma-3": ("<start_of_turn>user\n", "<start_of_turn>model\n")}
    for name, markers in expected.items():
        assert response_markers(get_chat_template(make_tokenizer("llama"), chat_template=name)) == markers


def test_vision_keywords_choose_lora_targets_on_a_text_model():
    from tiny_families import tiny_llama

    from unsloth.notebook.fast_model import lora_targets

    model = tiny_llama()
    assert lora_targets(model, None, True, True, False, False) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert lora_targets(model, None, True, False, True, True) == ["down_proj", "gate_proj", "up_proj"]
    with pytest.raises(ValueError, match="finetune_language_layers"):
        lora_targets(model, None, False, True, True, True)


def test_import_unsloth_stays_cheap():
    import subprocess
    import sys

    code = "import sys, unsloth; assert 'torch' not in sys.modules and 'trl' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_prequantized_names_resolve(tmp_path):
    from unsloth.models.loader import resolve_model_name

    assert resolve_model_name("unsloth/llama-3-8b-bnb-4bit", load_in_4bit=True) == "unsloth/llama-3-8b-bnb-4bit"
    assert resolve_model_name("unsloth/llama-3-8b-bnb-4bit", load_in_4bit=False) == "unsloth/llama-3-8b"
    assert resolve_model_name("unsloth/Qwen3-14B-unsloth-bnb-4bit", load_in_4bit=False) == "unsloth/Qwen3-14B"
    local = tmp_path / "my-bnb-4bit"
    local.mkdir()
    assert resolve_model_name(str(local), load_in_4bit=False) == str(local)  # a folder is what it is


def test_unsloth_training_arguments(trl):
    from unsloth import UnslothTrainer, UnslothTrainingArguments, unsloth_train

    args = UnslothTrainingArguments(output_dir="o", embedding_learning_rate=5e-5, max_seq_length=32)
    assert isinstance(args, trl.SFTConfig) and args.embedding_learning_rate == 5e-5 and args.max_length == 32
    assert issubclass(UnslothTrainer, trl.SFTTrainer) and callable(unsloth_train)


def test_generate_drops_token_type_ids_a_model_does_not_take(tmp_path, monkeypatch):
    """A fast tokenizer whose config names no inputs returns token_type_ids on transformers 4 (and on
    5 when asked); `model.generate(**inputs)` answers as without them on a Llama, which takes none."""
    import torch

    from tiny_notebook_models import write_model
    from unsloth import FastLanguageModel

    monkeypatch.setenv("UNSLOTH_KERNELS", "0")
    model, tokenizer = FastLanguageModel.from_pretrained(write_model(tmp_path / "llama", "llama"),
                                                         max_seq_length=64, load_in_4bit=False)
    FastLanguageModel.for_inference(model)
    inputs = tokenizer(["Name the capital of France."], return_tensors="pt", return_token_type_ids=True)
    assert "token_type_ids" in inputs
    out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    plain = {k: v for k, v in inputs.items() if k != "token_type_ids"}
    assert torch.equal(out, model.generate(**plain, max_new_tokens=3, do_sample=False))


def test_transformers_trainers_take_tokenizer_once(trl):
    import transformers

    from unsloth.training.trl_compat import CompatError

    trainer_cls = transformers.Trainer
    if "tokenizer" in inspect.signature(trainer_cls.__init__).parameters:
        pytest.skip("this transformers takes tokenizer= itself")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))
    tokenizer = make_tokenizer("llama")
    args = transformers.TrainingArguments(output_dir="o", report_to=[], use_cpu=True)
    assert trainer_cls(model=model, args=args, tokenizer=tokenizer).processing_class is tokenizer
    with pytest.raises(CompatError, match="'tokenizer' and 'processing_class' are the same argument"):
        trainer_cls(model=model, args=args, tokenizer=tokenizer, processing_class=tokenizer)
