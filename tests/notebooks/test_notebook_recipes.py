"""The recipe notebooks' cells on tiny random models: continued pretraining and text completion (Mistral v0.3:
embed_tokens / lm_head in target_modules, UnslothTrainer with embedding_learning_rate), tool calling
(Qwen2.5 Coder through FastQwen2Model, max_seq_length=None, apply_chat_template ids indexed as a tensor,
generate(sliding_window=None)), RAFT (Llama 3.2: SFT with an eval split) and QAT (qat_scheme: refused).

Not run: the tool-calling notebook's grammar-constrained decoding (transformers_cfg, not a dependency),
RAFT's dataset generation (llama_index and OpenAI), QAT's torchao cells (torchao is not a dependency).
"""

from __future__ import annotations

import copy
import os
import pickle
from threading import Thread

import pytest
import torch

from tiny_notebook_models import QA, write_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture
def kernels_off(monkeypatch):
    monkeypatch.setenv("UNSLOTH_KERNELS", "0")  # the cells are under test here; the kernels are covered elsewhere
    yield
    # datasets' map with num_proc (dataset_num_proc=1 below) rebinds os.environ to a copy, so monkeypatch's undo
    # would delete the variable from the old object only and leave kernels off for every later test
    os.environ.pop("UNSLOTH_KERNELS", None)


def _cpt_model(tmp_path, load_in_4bit):
    from unsloth import FastLanguageModel

    folder = write_model(tmp_path / "mistral-7b-v0.3", "mistral", sentencepiece=True)
    model, tokenizer = FastLanguageModel.from_pretrained(model_name=folder, max_seq_length=128, dtype=None,
                                                         load_in_4bit=load_in_4bit)
    model = FastLanguageModel.get_peft_model(
        model, r=8, target_modules=[*TARGETS, "embed_tokens", "lm_head"],  # "Add for continual pretraining"
        lora_alpha=32, lora_dropout=0, bias="none", use_gradient_checkpointing="unsloth", random_state=3407,
        use_rslora=True, loftq_config=None)
    return model, tokenizer


def _unsloth_trainer(model, tokenizer, dataset, output_dir, **args):
    from unsloth import UnslothTrainer, UnslothTrainingArguments

    return UnslothTrainer(
        model=model, tokenizer=tokenizer, train_dataset=dataset, dataset_text_field="text", max_seq_length=128,
        dataset_num_proc=1,
        args=UnslothTrainingArguments(per_device_train_batch_size=2, gradient_accumulation_steps=2, logging_steps=1,
                                      optim="adamw_8bit", seed=3407, output_dir=output_dir, report_to="none", **args))


@pytest.mark.slow
def test_continued_pretraining_trains_embeddings_whole_and_saves(tmp_path, kernels_off):
    from datasets import Dataset
    from peft.utils import ModulesToSaveWrapper
    from transformers import AutoModelForCausalLM, TextStreamer

    from unsloth import FastLanguageModel

    model, tokenizer = _cpt_model(tmp_path, load_in_4bit=True)  # the notebook's QLoRA: TRL casts to bf16
    for name in ("model.embed_tokens", "lm_head"):
        module = model.get_base_model().get_submodule(name)
        assert isinstance(module, ModulesToSaveWrapper) and module.weight.dtype == torch.float32

    EOS_TOKEN = tokenizer.eos_token
    wikipedia_prompt = "Wikipedia Article\n{}\n\n{}"

    def formatting_prompts_func(examples):
        return {"text": [wikipedia_prompt.format(title, text) + EOS_TOKEN
                         for title, text in zip(examples["title"], examples["text"])]}

    dataset = Dataset.from_list([{"title": q, "text": a} for q, a in QA]).map(formatting_prompts_func, batched=True)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "modules_to_save" in n}
    trainer = _unsloth_trainer(model, tokenizer, dataset, str(tmp_path / "outputs"), max_steps=3, warmup_steps=1,
                               learning_rate=5e-3, embedding_learning_rate=1e-3, weight_decay=0.001,
                               lr_scheduler_type="linear")
    trainer.train()
    groups = trainer.optimizer.param_groups
    assert [g["initial_lr"] for g in groups] == [5e-3, 1e-3] and len(groups[1]["params"]) == 2
    for name, old in before.items():  # trained, and still float32 after TRL's bf16 cast of a 4-bit model
        new = model.get_parameter(name)
        assert new.dtype == torch.float32 and not torch.equal(new, old), name

    # The second stage (instruction data), then the inference cells.
    alpaca_prompt = "Below is an instruction.\n{}\n{}"

    def formatting_alpaca(conversations):
        return {"text": [alpaca_prompt.format(c[0]["value"], c[1]["value"]) + EOS_TOKEN
                         for c in conversations["conversations"]]}

    alpaca = Dataset.from_list([{"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
                                for q, a in QA]).map(formatting_alpaca, batched=True)
    _unsloth_trainer(model, tokenizer, alpaca, str(tmp_path / "outputs"), max_steps=2, warmup_steps=1,
                     learning_rate=5e-3, embedding_learning_rate=1e-3, weight_decay=0.0).train()
    FastLanguageModel.for_inference(model)
    inputs = tokenizer([alpaca_prompt.format(QA[3][0], "")], return_tensors="pt")
    outputs = model.generate(**inputs, max_new_tokens=6, use_cache=True)
    assert outputs.shape[1] > inputs["input_ids"].shape[1] and tokenizer.batch_decode(outputs)
    model.generate(**inputs, streamer=TextStreamer(tokenizer), max_new_tokens=4, repetition_penalty=0.1)

    model.save_pretrained(tmp_path / "mistral_v0_lora")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "mistral_v0_lora" / "adapter_model.safetensors"), "pt") as saved:
        assert {"embed_tokens", "lm_head"} <= {k.split(".")[-2] for k in saved.keys()}
    model.save_pretrained_merged(str(tmp_path / "merged"), tokenizer, save_method="merged_16bit")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    ids = inputs["input_ids"]
    with torch.no_grad():  # the trained embeddings and head are in the merged weights
        torch.testing.assert_close(merged(input_ids=ids).logits, model(input_ids=ids).logits.float(),
                                   atol=5e-2, rtol=5e-2)


@pytest.mark.slow
def test_text_completion_streams_from_a_thread(tmp_path, kernels_off):
    from datasets import Dataset
    from transformers import TextIteratorStreamer

    from unsloth import FastLanguageModel

    model, tokenizer = _cpt_model(tmp_path, load_in_4bit=False)
    EOS_TOKEN = tokenizer.eos_token
    dataset = Dataset.from_list([{"text": "Once upon a time " + a} for _, a in QA]).map(
        lambda examples: {"text": [example + EOS_TOKEN for example in examples["text"]]}, batched=True)
    head = model.get_output_embeddings().weight.detach().clone()
    trainer = _unsloth_trainer(model, tokenizer, dataset, str(tmp_path / "outputs"), warmup_ratio=0.1,
                               num_train_epochs=1, learning_rate=5e-3, embedding_learning_rate=5e-4,
                               weight_decay=0.0, lr_scheduler_type="cosine")
    trainer.train()
    assert trainer.state.global_step == 2 and not torch.equal(model.get_output_embeddings().weight, head)

    text_streamer = TextIteratorStreamer(tokenizer)
    FastLanguageModel.for_inference(model)
    inputs = tokenizer(["Once upon a time, in a galaxy, far far away,"] * 1, return_tensors="pt")
    thread = Thread(target=model.generate, kwargs=dict(inputs, streamer=text_streamer, max_new_tokens=8,
                                                       use_cache=True))
    thread.start()
    streamed = "".join(new_text for new_text in text_streamer)
    thread.join()
    assert streamed.startswith("Once upon a time") or "Once upon a time" in streamed


# A chat template that renders tools and tool calls (the Qwen2.5 Coder tokenizer ships one).
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these tools:\n{%- for tool in tools %}\n{{ tool | tojson }}"
    "{%- endfor %}<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{%- if message.tool_calls %}{%- for call in message.tool_calls %}<tool_call>{{ call.function | tojson }}"
    "</tool_call>{%- endfor %}{%- else %}{{ message.content }}{%- endif %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


def test_tool_calling_cells(tmp_path, kernels_off):
    from transformers import AutoTokenizer
    from transformers.utils import chat_template_utils

    from unsloth import FastLanguageModel, FastQwen2Model

    folder = write_model(tmp_path / "Qwen2.5-Coder-1.5B-Instruct", "qwen2", max_position_embeddings=96)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = TOOL_TEMPLATE
    tokenizer.save_pretrained(folder)
    assert FastQwen2Model is FastLanguageModel
    model, tokenizer = FastQwen2Model.from_pretrained(model_name=folder, max_seq_length=None, dtype=None,
                                                      load_in_4bit=False, fix_tokenizer=False)
    assert model.max_seq_length == tokenizer.model_max_length == 96  # None: the model's own context
    tokenizer_orig = copy.deepcopy(tokenizer)

    def get_vector_sum(a: list[float], b: list[float]) -> list[float]:
        """
        Performs element-wise addition of two numerical vectors.

        Args:
            a: First vector containing numerical values
            b: Second vector containing numerical values
        """
        return [x + y for x, y in zip(a, b)]

    chat_template_utils.get_json_schema(get_vector_sum)
    user_query = {"role": "user", "content": "Find the sum of a = [1, -1, 2] and b = [3, 0, -4]."}
    tokenizer = copy.deepcopy(tokenizer_orig)
    input_ids = tokenizer.apply_chat_template([user_query], tokenize=True, add_generation_prompt=True,
                                              add_special_tokens=False, padding=True, tools=[get_vector_sum],
                                              return_tensors="pt")
    assert isinstance(input_ids, torch.Tensor) and "get_vector_sum" in tokenizer.decode(input_ids[0])
    output = model.generate(input_ids=input_ids, do_sample=False, repetition_penalty=1.1, num_return_sequences=1,
                            temperature=None, top_p=None, top_k=None, sliding_window=None, max_new_tokens=4)
    generated_tokens = output[:, input_ids.shape[1]:]
    assert generated_tokens.shape == (1, 4)
    tokenizer.batch_decode(generated_tokens, skip_special_tokens=True)

    messages = [{"role": "user", "content": user_query["content"]},
                {"role": "assistant", "tool_calls": [{"id": "a1b2c3d4e", "type": "function", "function": {
                    "name": "get_vector_sum", "arguments": {"a": [1, -1, 2], "b": [3, 0, -4]}}}]},
                {"role": "tool", "name": "get_vector_sum", "content": [4, -1, -2]},
                {"role": "assistant", "content": "Answer:\n"}]
    tokenizer = copy.deepcopy(tokenizer_orig)
    tool_prompt = tokenizer.apply_chat_template(messages, continue_final_message=True, add_special_tokens=True,
                                                return_tensors="pt", return_dict=True, tools=None)
    tool_prompt = tool_prompt.to(model.device)
    assert tokenizer.decode(tool_prompt["input_ids"][0]).endswith("Answer:\n")
    out = model.generate(**tool_prompt, max_new_tokens=4)
    assert out.shape[1] == tool_prompt["input_ids"].shape[1] + 4
    assert isinstance(AutoTokenizer.from_pretrained(model.config.name_or_path), type(tokenizer))

    # The copies answer for themselves, and a pickled tokenizer (datasets' num_proc) still loads.
    assert tokenizer.apply_chat_template.__self__ is tokenizer
    assert pickle.loads(pickle.dumps(tokenizer)).apply_chat_template([user_query], tokenize=False)


def test_qat_scheme_is_refused_naming_the_fix(tmp_path, kernels_off):
    from unsloth import FastLanguageModel
    from unsloth.errors import UnslothError

    folder = write_model(tmp_path / "Qwen3-4B-Instruct-2507", "qwen3")
    with pytest.raises(UnslothError, match="qat_scheme='int4'.*not supported") as error:
        FastLanguageModel.from_pretrained(model_name=folder, max_seq_length=64, full_finetuning=True,
                                          qat_scheme="int4")
    assert "remove qat_scheme" in str(error.value)
    model, _ = FastLanguageModel.from_pretrained(model_name=folder, max_seq_length=64, full_finetuning=False)
    with pytest.raises(UnslothError, match="torchao"):
        FastLanguageModel.get_peft_model(model, r=16, target_modules=TARGETS, lora_alpha=32, qat_scheme="int4",
                                         use_gradient_checkpointing="unsloth", random_state=3407)
    assert not hasattr(model, "peft_config")  # nothing was changed


@pytest.mark.slow
def test_raft_sft_with_an_eval_split(tmp_path, kernels_off):
    from datasets import Dataset
    from transformers import TrainingArguments
    from trl import SFTTrainer

    from unsloth import FastLanguageModel

    folder = write_model(tmp_path / "Llama-3.2-1B-Instruct", "llama")
    model, tokenizer = FastLanguageModel.from_pretrained(model_name=folder, max_seq_length=128, load_in_8bit=False,
                                                         full_finetuning=False)
    model = FastLanguageModel.get_peft_model(model, r=16, target_modules=TARGETS, lora_alpha=16, lora_dropout=0,
                                             bias="none", use_gradient_checkpointing="unsloth", random_state=2025,
                                             use_rslora=False, loftq_config=None)
    rows = [{"question": q, "context": f"Passage on: {q}", "oracle_context": a, "instruction": "Answer.",
             "cot_answer": a} for q, a in QA]
    splits = Dataset.from_list(rows).train_test_split(test_size=0.25, seed=0)

    def formatting_prompts_func(examples):
        texts = []
        for qn, ctx, oracle, instr, ans in zip(examples["question"], examples["context"], examples["oracle_context"],
                                               examples["instruction"], examples["cot_answer"]):
            prompt = (f"### Question:\n{qn}\n\n### Context:\n{ctx}\n\n### (Oracle Passages):\n{oracle}\n\n"
                      f"### Instruction:\n{instr}\n\n### Answer:\n")
            texts.append(prompt + ans + tokenizer.eos_token)
        return {"text": texts}

    train_ds = splits["train"].map(formatting_prompts_func, batched=True)
    eval_ds = splits["test"].map(formatting_prompts_func, batched=True)
    training_args = TrainingArguments(
        output_dir=str(tmp_path / "llama32_1bn_raft"), report_to="none", run_name="RAFT_SFT", eval_steps=2,
        eval_strategy="steps", per_device_train_batch_size=1, per_device_eval_batch_size=1,
        gradient_accumulation_steps=2, learning_rate=2e-3, max_steps=4, save_strategy="no",
        gradient_checkpointing=True, logging_strategy="steps", logging_steps=1, seed=42, optim="adamw_torch",
        lr_scheduler_type="cosine")
    trainer = SFTTrainer(model=model, tokenizer=tokenizer, train_dataset=train_ds, eval_dataset=eval_ds,
                         args=training_args, dataset_text_field="text")
    trainer.train()
    evals = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    assert len(evals) == 2 and all(torch.isfinite(torch.tensor(evals))), evals
