"""`unsloth train --demo` as a CPU user runs it: the loss falls, the answers are right, the model is saved."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_learns_the_task_and_saves_a_llama_folder(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # a plain CPU machine: kernels off, stock torch path
    out = tmp_path / "demo"
    run = subprocess.run([sys.executable, "-m", "unsloth.cli", "train", "--demo", "--output-dir", str(out)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    text = run.stdout + run.stderr
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


def test_a_short_demo_still_logs_and_reports_its_loss(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # a plain CPU run (the interpreter takes a minute here)
    run = subprocess.run([sys.executable, "-m", "unsloth.cli", "train", "--demo", "--max-steps", "3",
                          "--output-dir", str(tmp_path / "demo")], capture_output=True, text=True, env=env, timeout=300)
    assert re.search(r"loss [\d.]+ -> [\d.]+; \d+/\d+ answers right", run.stdout), run.stderr[-3000:]
    refused = subprocess.run([sys.executable, "-m", "unsloth.cli", "train", "--demo", "--max-steps", "0"],
                             capture_output=True, text=True, env=env, timeout=300)
    assert refused.returncode == 2 and "--max-steps must be 1 or more" in refused.stderr


@pytest.mark.slow
def test_vision_demo_learns_the_captions_and_saves_a_qwen2_5_vl_folder(tmp_path):
    pytest.importorskip("PIL")
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # a plain CPU machine: kernels off, stock torch path
    out = tmp_path / "vision"
    run = subprocess.run([sys.executable, "-m", "unsloth.cli", "train", "--demo", "vision", "--max-steps", "30",
                          "--output-dir", str(out)], capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    text = run.stdout + run.stderr
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", text).groups())
    assert last < 0.2 * first
    right, shown = map(int, re.search(r"(\d+)/(\d+) captions right", text).groups())
    assert shown == 12 and right >= 10
    assert "[ok ] picture of a red circle -> a red circle" in text
    merged = out / "merged"
    config = json.loads((merged / "config.json").read_text())
    assert config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert (merged / "processor_config.json").is_file() and (merged / "model.safetensors").is_file()
