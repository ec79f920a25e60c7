"""`unsloth generate` / `unsloth chat` on checkpoint directories not exported yet (LoRA adapters in the
layout `unsloth train` writes, a merged model): our generation path with the tokenizer's chat
template, giving transformers' own greedy tokens."""

from __future__ import annotations

import io
import json

import pytest
import torch

from export_models import make_model, make_tokenizer

pytestmark = pytest.mark.slow  # loads and decodes tiny models on the CPU

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A training output folder (run/lora: adapters + tokenizer) over a local base, and a merged folder."""
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("ckpt")
    tokenizer = make_tokenizer()
    make_model("llama").save_pretrained(root / "base")
    model = get_peft_model(make_model("llama"), LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                                                            target_modules=TARGETS))
    model.peft_config["default"].base_model_name_or_path = str(root / "base")
    model.save_pretrained(root / "run" / "lora")
    tokenizer.save_pretrained(root / "run" / "lora")
    merged = model.merge_and_unload()
    merged.save_pretrained(root / "merged")
    tokenizer.save_pretrained(root / "merged")
    plain = make_model("llama")  # no template: a base model's folder
    plain.save_pretrained(root / "plain")
    make_tokenizer().save_pretrained(root / "plain")
    config = json.loads((root / "plain" / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (root / "plain" / "tokenizer_config.json").write_text(json.dumps(config))
    (root / "plain" / "chat_template.jinja").unlink(missing_ok=True)
    return root, model.eval(), tokenizer


def _expected(model, tokenizer, prompt: str, new: int) -> str:
    """transformers' greedy reply to `prompt` rendered by the chat template."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=new, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True), ids["input_ids"].shape[1]


def _generate(capsys, *argv):
    from unsloth.cli import main

    code = main(["generate", *argv, "--cpu"])
    return code, capsys.readouterr()


@pytest.mark.parametrize("folder", ["run", "run/lora", "merged"])
def test_generate_on_a_checkpoint_is_the_trained_models_greedy_reply(trained, capsys, folder):
    root, model, tokenizer = trained
    code, out = _generate(capsys, str(root / folder), "The capital of France is", "--max-tokens", "6", "--json")
    assert code == 0, out.err
    report = json.loads(out.out)
    expected, prompt_tokens = _expected(model, tokenizer, "The capital of France is", 6)
    assert report["ok"] and report["text"] == expected
    assert report["prompt_tokens"] == prompt_tokens and 1 <= report["completion_tokens"] <= 6
    assert report["model"].endswith("lora" if folder.startswith("run") else "merged")


def test_streamed_and_raw_generation(trained, capsys):
    root, model, tokenizer = trained
    code, streamed = _generate(capsys, str(root / "run"), "Once upon a time", "--max-tokens", "5")
    assert code == 0, streamed.err
    code, as_json = _generate(capsys, str(root / "run"), "Once upon a time", "--max-tokens", "5", "--json")
    assert streamed.out == json.loads(as_json.out)["text"] + "\n"
    code, raw = _generate(capsys, str(root / "run"), "Once upon a time", "--raw", "--max-tokens", "5", "--json")
    ids = tokenizer("Once upon a time", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert json.loads(raw.out)["text"] == tokenizer.decode(out[0, ids["input_ids"].shape[1]:],
                                                           skip_special_tokens=True)


def test_chat_on_a_checkpoint_streams_the_greedy_reply(trained, capsys, monkeypatch):
    from unsloth.cli import main

    root, model, tokenizer = trained
    monkeypatch.setattr("sys.stdin", io.StringIO("The capital of France is\n/exit\n"))
    assert main(["chat", str(root / "run"), "--cpu", "--temperature", "0", "--max-tokens", "6"]) == 0
    out = capsys.readouterr()
    reply = out.out.split("\n")[0].removeprefix("> ")  # then the next "> " prompt, answered by /exit
    assert reply == _expected(model, tokenizer, "The capital of France is", 6)[0]
    assert "chatting with" in out.err and "lora" in out.err


def test_what_cannot_run_is_refused_naming_the_fix(trained, capsys, monkeypatch):
    from unsloth.cli import main

    root, _, _ = trained
    code, out = _generate(capsys, str(root / "run"), "hi " * 50, "--max-tokens", "8", "--n-ctx", "16", "--json")
    report = json.loads(out.out)
    assert code == 1 and "do not fit" in report["error"] and "--n-ctx" in report["fix"]
    monkeypatch.setattr("sys.stdin", io.StringIO("/exit\n"))
    assert main(["chat", str(root / "plain"), "--cpu"]) == 1
    err = capsys.readouterr().err
    assert "no chat template" in err and "--raw" in err
