"""The RL notebooks beyond Qwen2.5 GRPO (test_notebook_grpo.py), their cells on tiny random models.

Code games (Gemma4_(E2B)_Reinforcement_Learning_Sudoku_Game, Gemma4_(E2B)_GRPO's matmul): the sandbox
helpers they import from unsloth, then FastVisionModel -> text-only GRPO with the processor as
processing_class and epsilon_high / delta / bnpo / mask_truncated_completions -> save -> generate.
Vision GRPO (Qwen3_VL_(8B)-Vision-GRPO, Qwen3_5_(4B)_Vision_GRPO, Gemma3_(4B)-Vision-GRPO's model):
the MathVista-shaped dataset, `tokenizer(image, prompt_messages)`, GSPO settings, train, save.
"""

from __future__ import annotations

import time

import pytest
import torch

from tiny_vision import build_processor, images, save_tiny_vision

STRATEGY = '''
def strategy(board, initial):
    for r in range(9):
        for c in range(9):
            if board[r][c] == 0:
                return (r, c, 1)
    return (0, 0, 1)
'''


@pytest.fixture
def one_thread(monkeypatch):
    monkeypatch.setenv("UNSLOTH_KERNELS", "0")  # the cells are under test here; the kernels are covered elsewhere
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_code_game_helpers_check_imports_lock_globals_and_limit_time():
    import numpy as np

    from unsloth import check_python_modules, create_locked_down_function, execute_with_time_limit

    assert check_python_modules(STRATEGY) == (True, {"stdlib": [], "non_stdlib": [], "relative_imports": 0})
    ok, info = check_python_modules("def strategy(b, i):\n    import numpy as np\n    from os import path\n")
    assert not ok and info["non_stdlib"] == ["numpy"] and info["stdlib"] == ["os"]
    ok, info = check_python_modules("def a")
    assert not ok and "error" in info

    strategy = create_locked_down_function(STRATEGY)
    assert strategy([[0] * 9] * 9, [[0] * 9] * 9) == (0, 0, 1) and strategy.__globals__ == {}
    peek = create_locked_down_function("def matmul(A, B):\n    return np.matmul(A, B)")
    assert np is not None  # the caller's numpy is not the function's
    with pytest.raises(NameError, match="'np'"):
        peek([[1]], [[1]])
    for bad in ("def a", "x = 1\ndef f():\n    return x", "import os"):
        with pytest.raises(ValueError):
            create_locked_down_function(bad)

    @execute_with_time_limit(0.2)
    def spin(seconds):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
        return "done"

    assert spin(0.01) == "done"
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        spin(5)
    assert time.monotonic() - start < 2
    with pytest.raises(ValueError, match="seconds must be > 0"):
        execute_with_time_limit(0)


def test_a_processor_takes_a_conversation_as_its_text():
    """`tokenizer(image, dataset[i]["prompt"])`: the conversation rendered with its generation prompt."""
    from unsloth.models.vision import with_tokenizer_attributes

    processor = with_tokenizer_attributes(build_processor("qwen3_vl"))
    picture = images(1)[0]
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "t5 t6"}]}]
    rendered = processor.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    expected = processor(picture, rendered, return_tensors="pt")["input_ids"]
    assert torch.equal(processor(picture, conversation, return_tensors="pt")["input_ids"], expected)
    assert torch.equal(processor(images=picture, text=conversation, return_tensors="pt")["input_ids"], expected)
    plain = processor(picture, conversation, add_generation_prompt=False, return_tensors="pt")["input_ids"]
    assert plain.shape[1] < expected.shape[1]
    assert expected[0, -2:].tolist() == processor.convert_tokens_to_ids(["<|im_start|>", "assistant"])


def _gemma4(folder):
    from transformers import AutoModelForImageTextToText

    from tiny_vision import build_tokenizer, vision_config

    tokenizer = build_tokenizer("gemma4")
    tokenizer.add_tokens(["<|turn>", "<turn|>"], special_tokens=True)
    processor = build_processor("gemma4", tokenizer=tokenizer)
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(vision_config("gemma4", processor.tokenizer)).save_pretrained(folder)
    processor.save_pretrained(folder)
    return str(folder)


@pytest.mark.slow
def test_the_sudoku_notebook_trains_gemma4_through_fastvisionmodel(tmp_path, one_thread, monkeypatch):
    from datasets import Dataset
    from safetensors import safe_open
    from transformers import TextStreamer

    from unsloth import FastVisionModel, check_python_modules, create_locked_down_function, execute_with_time_limit
    from trl import GRPOConfig, GRPOTrainer  # noqa: I001 - after unsloth, as in the notebook

    monkeypatch.chdir(tmp_path)
    max_seq_length, lora_rank = 128, 8
    model, tokenizer = FastVisionModel.from_pretrained(model_name=_gemma4(tmp_path / "gemma-4-E2B-it"),
                                                       max_seq_length=max_seq_length, load_in_4bit=False,
                                                       fast_inference=False)
    model = FastVisionModel.get_peft_model(
        model, r=lora_rank,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        lora_alpha=lora_rank * 2, use_gradient_checkpointing="unsloth", random_state=3407)

    prompt = "t5 t6 t7"
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    inputs = tokenizer(text=text, add_special_tokens=False, return_tensors="pt").to("cpu")
    model.generate(**inputs, streamer=TextStreamer(tokenizer, skip_prompt=True), max_new_tokens=4, use_cache=True,
                   temperature=1.0, top_p=0.95, top_k=64)

    @execute_with_time_limit(10)
    def execute_strategy(strategy, board):
        return strategy(board, board)

    def function_works(completions, **kwargs):
        # the completions are the tiny model's noise: score a fixed strategy beside each, as the notebook would
        scores = []
        for completion in completions:
            ok, info = check_python_modules(STRATEGY)
            new_strategy = create_locked_down_function(STRATEGY)
            scores.append(float(ok) + execute_strategy(new_strategy, [[0] * 9] * 9)[2]
                          + len(completion[0]["content"]) / 100)
        return scores

    def no_cheating(completions, **kwargs):
        return [1.0 if check_python_modules(c[0]["content"])[0] else -1.0 for c in completions]

    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": prompt}], "answer": 0}] * 4)
    maximum_length = len(tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                       add_generation_prompt=True))
    training_args = GRPOConfig(
        temperature=1.0, learning_rate=5e-3, weight_decay=0.001, warmup_ratio=0.1, lr_scheduler_type="linear",
        optim="adamw_torch", logging_steps=1, per_device_train_batch_size=1, gradient_accumulation_steps=2,
        num_generations=2, max_completion_length=min(6, max_seq_length - (maximum_length + 1)), max_steps=2,
        save_steps=100, report_to="none", output_dir="outputs", epsilon=0.2, epsilon_high=0.28, delta=1.5,
        loss_type="bnpo", mask_truncated_completions=False)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[function_works, no_cheating],
                          args=training_args, train_dataset=dataset)
    trainer.train()
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if p.requires_grad)
    assert trainer.state.log_history[0]["rewards/function_works/mean"] > 2  # the strategy ran: ok + its row 0

    model.save_pretrained("gemma_4_lora")
    tokenizer.save_pretrained("gemma_4_lora")
    with safe_open("gemma_4_lora/adapter_model.safetensors", framework="pt") as f:
        assert all((f.get_tensor(k) == 0).sum() != f.get_tensor(k).numel() for k in f.keys())
    out = model.generate(**tokenizer(images=None, text=text, return_tensors="pt").to("cpu"), temperature=1.0,
                         max_new_tokens=4, streamer=TextStreamer(tokenizer, skip_prompt=False))
    assert out.shape[1] > inputs["input_ids"].shape[1]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5", "gemma3"])
def test_the_vision_grpo_notebook(family, tmp_path, one_thread, monkeypatch):
    from datasets import Dataset
    from safetensors import safe_open
    from transformers import TextStreamer

    from unsloth import FastVisionModel
    from trl import GRPOConfig, GRPOTrainer  # noqa: I001 - after unsloth, as in the notebook

    monkeypatch.chdir(tmp_path)
    model, tokenizer = FastVisionModel.from_pretrained(
        model_name=save_tiny_vision(family, tmp_path / family), max_seq_length=16384, load_in_4bit=False,
        fast_inference=False, gpu_memory_utilization=0.8)
    model = FastVisionModel.get_peft_model(
        model, finetune_vision_layers=False, finetune_language_layers=True, finetune_attention_modules=True,
        finetune_mlp_modules=True, r=16, lora_alpha=16, lora_dropout=0, bias="none", random_state=3407,
        use_rslora=False, loftq_config=None, use_gradient_checkpointing="unsloth")

    pictures = images(4)
    dataset = Dataset.from_list([{"decoded_image": pictures[i], "image": None, "question": f"t{5 + i} t6",
                                  "answer": str(i) if i % 3 else "t9"} for i in range(4)])

    def is_numeric_answer(example):
        try:
            float(example["answer"])
            return True
        except ValueError:
            return False

    dataset = dataset.filter(is_numeric_answer)
    dataset = dataset.map(lambda example: {"decoded_image": example["decoded_image"].resize((32, 32)).convert("RGB")})

    def make_conversation(example):
        prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": example["question"]}]}]
        return {"prompt": prompt, "image": example["decoded_image"], "answer": example["answer"]}

    train_dataset = dataset.map(make_conversation)
    train_dataset = train_dataset.remove_columns("image")
    train_dataset = train_dataset.rename_column("decoded_image", "image")
    assert len(train_dataset) == 2

    def formatting_reward_func(completions, **kwargs):
        completions = [(c[0]["content"] if c else "") if isinstance(c, list) else c for c in completions]
        return [len(c) / 10 for c in completions]

    def correctness_reward_func(prompts, completions, answer, **kwargs):
        completions = [(c[0]["content"] if c else "") if isinstance(c, list) else c for c in completions]
        return [2.0 if a in c else 0.0 for c, a in zip(completions, answer)]

    image, prompt = train_dataset[1]["image"], train_dataset[1]["prompt"]
    inputs = tokenizer(image, prompt, add_special_tokens=False, return_tensors="pt").to("cpu")
    assert "pixel_values" in inputs
    model.generate(**inputs, streamer=TextStreamer(tokenizer, skip_prompt=True), max_new_tokens=4, use_cache=True,
                   temperature=1.0, min_p=0.1)

    training_args = GRPOConfig(
        learning_rate=5e-3, adam_beta1=0.9, adam_beta2=0.99, weight_decay=0.1, warmup_ratio=0.1,
        lr_scheduler_type="cosine", optim="adamw_torch", logging_steps=1, log_completions=False,
        per_device_train_batch_size=1, gradient_accumulation_steps=1, num_generations=2, max_prompt_length=1024,
        max_completion_length=6, max_steps=2, save_steps=60, max_grad_norm=0.1, report_to="none",
        output_dir="outputs", importance_sampling_level="sequence", mask_truncated_completions=False,
        loss_type="dr_grpo")
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    trainer = GRPOTrainer(model=model, args=training_args, processing_class=tokenizer,
                          reward_funcs=[formatting_reward_func, correctness_reward_func], train_dataset=train_dataset)
    trainer.train()
    assert trainer.state.log_history[0]["grad_norm"] > 0
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if p.requires_grad)

    model.save_pretrained("grpo_lora")
    tokenizer.save_pretrained("grpo_lora")
    with safe_open("grpo_lora/adapter_model.safetensors", framework="pt") as f:
        assert all((f.get_tensor(k) == 0).sum() != f.get_tensor(k).numel() for k in f.keys())
    # Gemma 3's notebook renders the messages first, then calls the processor with the text
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "t5"}]}]
    input_text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    inputs = tokenizer(image, input_text, add_special_tokens=False, return_tensors="pt").to("cpu")
    out = model.generate(**inputs, max_new_tokens=4, use_cache=True, temperature=1.0, top_p=0.95, top_k=64)
    assert out.shape[1] > inputs["input_ids"].shape[1]
