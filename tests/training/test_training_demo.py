"""`unsloth train --demo` as a CPU user runs it: the loss falls, the answers are right, the model is saved."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest


ENV = {**os.environ, "TRITON_INTERPRET": "0"}  # a plain CPU machine: kernels off, stock torch path


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo as the README runs it: (its output folder, what it printed)."""
    out = tmp_path_factory.mktemp("demo") / "demo"
    run = subprocess.run([sys.executable, "-m", "unsloth.cli", "train", "--demo", "--output-dir", str(out)],
                         capture_output=True, text=True, env=ENV, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return out, run.stdout + run.stderr


@pytest.mark.slow
def test_demo_learns_the_task_and_saves_a_llama_folder(demo):
    out, text = demo
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", text).groups())
    assert last < 0.5 * first
    right, shown = map(int, re.search(r"(\d+)/(\d+) answers right", text).groups())
    assert shown >= 5 and right >= shown - 1
    assert "[ok ] What is the capital of France? -> Paris" in text
    losses = [json.loads(line)["loss"] for line in (out / "loss_log.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert len(losses) >= 10 and losses[-1] < losses[0]

    merged = out / "merged"
    config = json.loads((merged / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    tokenizer = json.loads((merged / "tokenizer.json").read_text())
    assert tokenizer["model"]["type"] == "BPE" and tokenizer["pre_tokenizer"]["type"] == "ByteLevel"
    assert (merged / "model.safetensors").is_file()
    assert "chat_template" in (merged / "tokenizer_config.json").read_text() or (merged / "chat_template.jinja").is_file()


@pytest.mark.slow
def test_the_demo_answers_every_turn_of_one_chat(demo, tmp_path):
    """The README's next steps: export the demo, then ask it several questions in one `unsloth chat`.
    Each turn is sent with the whole conversation before it; every answer is the right capital."""
    out, _ = demo
    export = subprocess.run([sys.executable, "-m", "unsloth.cli", "export", str(out / "merged"), "--gguf", "f16",
                             "--no-validate", "--out", str(tmp_path / "gguf")], capture_output=True, text=True,
                            env=ENV, timeout=300)
    assert export.returncode == 0, export.stderr[-3000:]
    gguf = next((tmp_path / "gguf").glob("*.gguf"))
    asked = [("What is the capital of Greece?", "Athens"), ("What is the capital of Peru?", "Lima"),
             ("Name the capital city of Japan.", "Tokyo"), ("Which city is the capital of Kenya?", "Nairobi"),
             ("What is the capital of Canada?", "Ottawa")]
    chat = subprocess.run([sys.executable, "-m", "unsloth.cli", "chat", str(gguf), "--cpu", "--temperature", "0",
                           "--max-tokens", "16"], input="".join(q + "\n" for q, _ in asked), capture_output=True,
                          text=True, env=ENV, timeout=300)
    assert chat.returncode == 0, chat.stderr[-3000:]
    replies = [line.strip() for line in chat.stdout.split("> ") if line.strip()]  # input()'s prompt, then each reply
    assert len(replies) == len(asked)
    right = [reply == answer for reply, (_, answer) in zip(replies, asked)]
    # Trained on single questions only, it answered every later turn from the first ("Peru?" -> "Berlin").
    assert right[0] and sum(right) >= len(asked) - 1, list(zip(replies, asked))


def test_a_short_demo_still_logs_and_reports_its_loss(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # a plain CPU run (the interpreter takes a minute here)
    run = subprocess.run([sys.executable, "-m", "unsloth.cli", "train", "--demo", "--max-steps", "3",
                          "--output-dir", str(tmp_path / "demo")], capture_output=True, text=True, env=env, timeout=300)
    assert re.search(r"loss [\d.]+ -> [\d.]+; \d+/\d+ answers right", run.stdout), run.stderr[-3000:]
    refused = subprocess.run([sys.executable, "-m", "unsloth.cli", "train", "--demo", "--max-steps", "0"],
                             capture_output=True, text=True, env=env, timeout=300)
    assert refused.returncode == 2 and "--max-steps must be 1 or more" in refused.stderr
