"""The notebooks of families we do not patch (they train through the generic fast path), their cells in
order with their keywords, on tiny random models: LFM2.5 conversational (short-conv + attention),
Falcon-H1 Alpaca (Mamba 2 + attention), Granite 4.0 350M (dense) and Granite 4.0 h (Mamba 2 + NoPE
attention), ERNIE 4.5 MoE conversational (SentencePiece tokenizer, as released), Nemotron 3 Nano
(Mamba 2, MoE and attention layers; its notebook's extra load keywords), FunctionGemma (tool calls).
Each: load -> get_peft_model -> format -> SFTTrainer -> train_on_responses_only -> train (loss falls)
-> generate -> save adapters -> merged 16-bit (same logits) -> GGUF f16 through llama.cpp's converter.
"""

from __future__ import annotations

import json
import os

import pytest

pytestmark = pytest.mark.slow  # training, then a GGUF export validated through llama.cpp
import torch

from tiny_notebook_models import QA, alpaca_rows, losses_of, sharegpt_rows, write_model

NOTEBOOKS = ("lfm2", "falcon_h1", "granite_350m", "granite_h", "ernie", "nemotron", "functiongemma")
# notebook -> (tiny family, its tokenizer's SPECIALS entry, write_model options)
MODELS = {
    "lfm2": ("lfm2", None, {}),
    "falcon_h1": ("falcon_h1", None, {}),
    "granite_350m": ("granitemoehybrid", None, {"num_experts_per_tok": 0}),  # dense, as released
    "granite_h": ("granitemoehybrid_mamba", None, {}),
    "ernie": ("ernie4_5_moe", None, {"sentencepiece": True}),
    "nemotron": ("nemotron_h", None, {}),
    "functiongemma": ("gemma3_text", "gemma3_text_tools", {"query_pre_attn_scalar": 16}),
}
ALPACA = ("Below is an instruction that describes a task, paired with an input that provides further context. "
          "Write a response that appropriately completes the request.\n\n### Instruction:\n{}\n\n### Input:\n{}\n\n"
          "### Response:\n{}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def _tool_rows():
    """Rows shaped as the FunctionGemma notebook's dataset (TxT360 agent): a JSON `messages` string, the tools
    on the first message, each assistant turn's reasoning under "think", calls in the flat form."""
    rows = []
    for q, a in QA:
        messages = [{"role": "system", "content": "You help.", "tools": [WEATHER["function"]]},
                    {"role": "user", "content": q},
                    {"role": "assistant", "content": "", "think": "Call it.", "tool_calls": [
                        {"id": "c1", "name": "get_weather", "arguments": json.dumps({"city": "Lima"})}]},
                    {"role": "tool", "tool_call_id": "c1", "content": '{"temp_c": 25}'},
                    {"role": "assistant", "content": a, "think": "Answer."}]
        rows.append({"messages": json.dumps(messages)})
    return rows * 2


def _prepare_messages_and_tools(example):
    """The notebook's conversion: reasoning into <think> blocks, calls into OpenAI's nested form, tool
    results named after their call, tools into the chat template's shape."""
    messages = [dict(m) for m in json.loads(example["messages"])]
    tools = messages[0].pop("tools", None) or []
    names = {}
    for m in messages:
        if m["role"] == "assistant":
            m["content"] = f"<think>{m.pop('think')}</think>" + ("\n" + m["content"] if m["content"] else "")
        calls = []
        for call in m.get("tool_calls") or []:
            names[call["id"]] = call["name"]
            calls.append({"id": call["id"], "type": "function",
                          "function": {"name": call["name"], "arguments": json.loads(call["arguments"])}})
        if calls:
            m["tool_calls"] = calls
        if m["role"] == "tool":
            m["name"] = names.get(m["tool_call_id"], "unknown_tool")
    return messages, [{"type": "function", "function": t} for t in tools]


def _dataset(name, tokenizer):
    from datasets import Dataset

    from unsloth.chat_templates import standardize_data_formats

    if name == "falcon_h1":
        def alpaca(examples):
            return {"text": [ALPACA.format(i, n, o) + tokenizer.eos_token
                             for i, n, o in zip(examples["instruction"], examples["input"], examples["output"])]}

        return Dataset.from_list(alpaca_rows()).map(alpaca, batched=True)
    if name in ("lfm2", "ernie"):
        dataset = standardize_data_formats(Dataset.from_list(sharegpt_rows()))
        if name == "lfm2":
            def chat(examples):
                texts = tokenizer.apply_chat_template(examples["conversations"], tokenize=False,
                                                      add_generation_prompt=False)
                return {"text": [x.removeprefix(tokenizer.bos_token) for x in texts]}
        else:
            def chat(examples):
                return {"text": [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=False)
                                 + tokenizer.eos_token for c in examples["conversations"]]}
        return dataset.map(chat, batched=True)
    if name.startswith("granite"):  # the support-bot sheet: snippet -> recommendation
        def turns(examples):
            return {"text": [tokenizer.apply_chat_template([{"role": "user", "content": u},
                                                            {"role": "assistant", "content": r}], tokenize=False,
                                                           add_generation_prompt=False)
                             for u, r in zip(examples["snippet"], examples["recommendation"])]}

        rows = {"snippet": [q for q, _ in QA * 2], "recommendation": [a for _, a in QA * 2]}
        return Dataset.from_dict(rows).map(turns, batched=True)
    if name == "nemotron":  # OpenMathReasoning-mini's columns
        rows = {"problem": [q for q, _ in QA * 2], "generated_solution": [f"<think>\nShort.\n</think>\n{a}"
                                                                           for _, a in QA * 2]}

        def conversations(examples):
            return {"conversations": [[{"role": "user", "content": p}, {"role": "assistant", "content": s}]
                                      for p, s in zip(examples["problem"], examples["generated_solution"])]}

        def chat(examples):
            return {"text": [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=False)
                             for c in examples["conversations"]]}

        return Dataset.from_dict(rows).map(conversations, batched=True).map(chat, batched=True)

    def format_example(example):
        messages, tools = _prepare_messages_and_tools(example)
        text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=False, tokenize=False)
        return {"text": text.removeprefix("<bos>")}

    return Dataset.from_list(_tool_rows()).map(format_example).filter(lambda x: x["text"] is not None)


def _load(name, folder):
    from unsloth import FastLanguageModel, FastModel

    lora = dict(lora_dropout=0, bias="none", use_gradient_checkpointing="unsloth", random_state=3407,
                use_rslora=False, loftq_config=None)
    if name == "ernie":
        model, tokenizer = FastModel.from_pretrained(model_name=folder, max_seq_length=128, full_finetuning=False)
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        return FastModel.get_peft_model(model, r=8, target_modules=targets, lora_alpha=16, **lora), tokenizer
    options = {
        "lfm2": dict(load_in_4bit=False, load_in_8bit=False, load_in_16bit=True, full_finetuning=False),
        "falcon_h1": dict(dtype=None, load_in_4bit=False),
        "nemotron": dict(full_finetuning=False, trust_remote_code=True, unsloth_force_compile=True,
                         attn_implementation="eager"),
        "functiongemma": dict(load_in_16bit=True, full_finetuning=False),
    }.get(name, dict(full_finetuning=False))
    model, tokenizer = FastLanguageModel.from_pretrained(model_name=folder, max_seq_length=128, **options)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    targets = {"lfm2": ["q_proj", "k_proj", "v_proj", "out_proj", "in_proj", "w1", "w2", "w3"],
               "granite_350m": targets + ["shared_mlp.input_linear", "shared_mlp.output_linear"],
               "granite_h": targets + ["shared_mlp.input_linear", "shared_mlp.output_linear"],
               "nemotron": targets + ["in_proj", "out_proj"]}.get(name, targets)
    if name == "falcon_h1":
        lora.update(lora_dropout=0.1, use_gradient_checkpointing=False)
    return FastLanguageModel.get_peft_model(model, r=16, target_modules=targets, lora_alpha=16, **lora), tokenizer


@pytest.fixture(scope="module", params=NOTEBOOKS)
def notebook(request, tmp_path_factory):
    os.environ["UNSLOTH_KERNELS"] = "0"  # the cells are under test here; the kernels are covered elsewhere
    name = request.param
    family, tokenizer_family, options = MODELS[name]
    root = tmp_path_factory.mktemp(name)
    folder = write_model(root / name, family, tokenizer_family=tokenizer_family, **options)
    model, tokenizer = _load(name, folder)
    dataset = _dataset(name, tokenizer)

    from trl import SFTConfig, SFTTrainer

    config = dict(per_device_train_batch_size=2, gradient_accumulation_steps=1, warmup_steps=1, max_steps=5,
                  learning_rate=2e-2, logging_steps=1, optim="adamw_8bit", weight_decay=0.001,
                  lr_scheduler_type="linear", seed=3407, output_dir=str(root / "outputs"), report_to="none")
    if name == "falcon_h1":
        trainer = SFTTrainer(model=model, tokenizer=tokenizer, train_dataset=dataset, dataset_text_field="text",
                             max_seq_length=128, dataset_num_proc=1, packing=False, args=SFTConfig(**config))
    else:
        trainer = SFTTrainer(model=model, tokenizer=tokenizer, train_dataset=dataset, eval_dataset=None,
                             args=SFTConfig(dataset_text_field="text", **config))
    from unsloth.chat_templates import train_on_responses_only

    if name == "ernie":
        trainer = train_on_responses_only(trainer, instruction_part="User:", response_part="Assistant:")
    elif name == "nemotron":
        trainer = train_on_responses_only(trainer, instruction_part="<|im_start|>user\n",
                                          response_part="<|im_start|>assistant\n")
    elif name != "falcon_h1":
        trainer = train_on_responses_only(trainer)  # markers read off the chat template
    trainer.train()
    yield name, root, model, tokenizer, trainer
    os.environ.pop("UNSLOTH_KERNELS", None)


def test_trains_on_the_replies_only(notebook):
    name, _, model, tokenizer, trainer = notebook
    losses = losses_of(trainer)
    assert losses[-1] < losses[0], losses
    if name != "falcon_h1":
        row = trainer.train_dataset[1]
        kept = tokenizer.decode([x for x in row["labels"] if x != -100])
        assert QA[1][1] in kept and QA[1][0] not in kept, kept
    if name == "nemotron":  # peft refuses LoRA on Mamba's out_proj: left out, the rest adapted
        adapted = {n.rsplit(".", 2)[-2] for n, _ in model.named_modules() if n.endswith("lora_A")}
        assert "in_proj" in adapted and "out_proj" not in adapted, adapted


def test_generates(notebook):
    from transformers import TextStreamer

    from unsloth import FastLanguageModel

    name, _, model, tokenizer, _ = notebook
    FastLanguageModel.for_inference(model)
    if name == "falcon_h1":
        inputs = tokenizer([ALPACA.format("Continue the fibonacci sequence.", "1, 1, 2, 3, 5, 8", "")],
                           return_tensors="pt")
    elif name == "functiongemma":
        messages, tools = _prepare_messages_and_tools(_tool_rows()[0])
        text = tokenizer.apply_chat_template(messages[:2], tools=tools, tokenize=False, add_generation_prompt=True)
        inputs = tokenizer(text.removeprefix("<bos>"), return_tensors="pt")
    else:
        inputs = tokenizer.apply_chat_template([{"role": "user", "content": QA[0][0]}], add_generation_prompt=True,
                                               return_tensors="pt", tokenize=True, return_dict=True)
    out = model.generate(**inputs, max_new_tokens=6, do_sample=False,
                         streamer=TextStreamer(tokenizer, skip_prompt=True))
    assert out.shape[1] > inputs["input_ids"].shape[1]


# Gaps found and not fixed yet (strict: the test says so once they are)
KNOWN_EXPORT_GAPS = {
    "ernie": "llama.cpp tokenizes the tiny SentencePiece vocab (no dummy prefix) unlike transformers",
    "nemotron": "the merged 16-bit model's logits differ from the LoRA model's (up to 0.18)",
}


def test_saves_adapters_merged_and_gguf(notebook, request):
    from transformers import AutoModelForCausalLM

    name, root, model, tokenizer, _ = notebook
    if name in KNOWN_EXPORT_GAPS:
        request.node.add_marker(pytest.mark.xfail(strict=True, reason=KNOWN_EXPORT_GAPS[name]))
    model.save_pretrained(root / "lora")
    tokenizer.save_pretrained(root / "lora")
    assert (root / "lora" / "adapter_model.safetensors").is_file()
    model.save_pretrained_merged(str(root / "merged"), tokenizer, save_method="merged_16bit")
    merged = AutoModelForCausalLM.from_pretrained(root / "merged", dtype=torch.float32)
    ids = torch.tensor([tokenizer(QA[0][0])["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, model(input_ids=ids).logits.float(),
                                   atol=2e-2, rtol=2e-2)
    if name in ("granite_350m", "functiongemma"):
        return  # their GGUF exports are covered already (tests/export, the Gemma 3 notebook's test)
    result = model.save_pretrained_gguf(str(root / "gguf"), tokenizer, quantization_method="F16")
    report = result.validations["f16"]
    assert report.passed, report.summary()


def test_a_vision_language_checkpoint_loads_through_fast_language_model(tmp_path, monkeypatch):
    """Magistral Small 2509 is Mistral 3 (a Pixtral tower behind Mistral): its notebook loads it with
    FastLanguageModel, which hands it to the vision loader (AutoModelForCausalLM has no Mistral 3)."""
    from unsloth import FastLanguageModel, FastVisionModel

    folder = write_model(tmp_path / "Magistral-Small-2509", "mistral3", tokenizer_family="mistral")
    loaded = []
    monkeypatch.setattr(FastVisionModel, "from_pretrained",
                        staticmethod(lambda *args, **kwargs: loaded.append(kwargs["model_name"]) or ("m", "p")))
    loaded_as = FastLanguageModel.from_pretrained(model_name=folder, full_finetuning=False, device_map="balanced")
    assert loaded_as == ("m", "p")
    assert loaded == [folder]
