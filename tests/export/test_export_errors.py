"""Clear errors, nothing lost: each failure names the problem and the fix, writes nothing under a
final name, leaves no partial file, and keeps an existing file intact."""

from __future__ import annotations

import errno
import json
import shutil
import sys
from collections import namedtuple

import pytest

from export_models import fake_tree, make_model, make_tokenizer
from unsloth.export import ExportError
from unsloth.export.gguf import save_pretrained_gguf


@pytest.fixture(scope="module")
def model():
    return make_model("llama")


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def files_in(directory):
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def test_unsupported_architecture_is_refused_before_any_work(tmp_path, tok, monkeypatch):
    """Neither our converter nor llama.cpp's (here one that knows only Qwen3.5) has GPT-2."""
    from transformers import GPT2Config, GPT2LMHeadModel

    monkeypatch.setenv("UNSLOTH_LLAMA_CPP", str(fake_tree(tmp_path / "llama.cpp", table=["Qwen3_5ForCausalLM"])))
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=384))
    with pytest.raises(ExportError, match=r"does not support GPT2LMHeadModel \('gpt2'\)") as info:
        save_pretrained_gguf(gpt2, tmp_path / "out", tok, "q8_0")
    assert "llama-cpp-python" in info.value.fix
    assert files_in(tmp_path / "out") == []


def test_missing_llama_cpp_is_named_with_the_fix(tmp_path, model, tok, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp -> ImportError
    with pytest.raises(ExportError, match="llama.cpp is not available") as info:
        save_pretrained_gguf(model, tmp_path / "out", tok, "q4_k_m")
    assert "unsloth install" in info.value.fix
    assert files_in(tmp_path / "out") == []


def test_not_enough_disk_is_refused_before_writing(tmp_path, model, tok, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 4096, 4096))
    with pytest.raises(ExportError, match=r"needs about .* GiB .* only 0.00 GiB is free") as info:
        save_pretrained_gguf(model, tmp_path / "out", tok, ["f16", "q8_0"], validate_export=False)
    assert "--out" in info.value.fix
    assert files_in(tmp_path / "out") == []


def _fail_after_first_tensor(monkeypatch, error):
    import gguf

    original = gguf.GGUFWriter.write_tensor_data
    calls = []

    def write(self, tensor, *args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise error
        return original(self, tensor, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", write)


def test_full_disk_mid_write_leaves_nothing_behind(tmp_path, model, tok, monkeypatch):
    _fail_after_first_tensor(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(ExportError, match="the disk filled up while writing model.F16.gguf"):
        save_pretrained_gguf(model, tmp_path, tok, "f16", validate_export=False)
    assert files_in(tmp_path) == []


def test_interrupted_export_keeps_the_previous_file(tmp_path, model, tok, monkeypatch):
    (tmp_path / "model.F16.gguf").write_bytes(b"previous export")
    _fail_after_first_tensor(monkeypatch, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        save_pretrained_gguf(model, tmp_path, tok, "f16", validate_export=False)
    assert files_in(tmp_path) == ["model.F16.gguf"]
    assert (tmp_path / "model.F16.gguf").read_bytes() == b"previous export"


def test_an_f16_export_that_disagrees_is_refused(tmp_path, model, tok, monkeypatch):
    # Simulate a converter bug: Q/K rows left in HF order, so llama.cpp's RoPE is applied wrongly.
    monkeypatch.setattr("unsloth.export.converter.permute_for_ggml", lambda weight, n_head: weight)
    with pytest.raises(ExportError, match="does not reproduce the model") as info:
        save_pretrained_gguf(model, tmp_path, tok, ["f16", "q8_0"])
    assert "it was not kept" in str(info.value)
    assert files_in(tmp_path) == []


def test_unsupported_tokenizer_is_refused(tmp_path, model):
    from tokenizers import pre_tokenizers

    whitespace = make_tokenizer(pre_tokenizer=pre_tokenizers.Whitespace())
    with pytest.raises(ExportError, match="pre-tokenizer .* is not one llama.cpp implements"):
        save_pretrained_gguf(model, tmp_path, whitespace, "f16", validate_export=False)
    assert files_in(tmp_path) == []


def test_f16_overflow_points_to_bf16(tmp_path, tok):
    import torch

    big = make_model("llama")
    with torch.no_grad():
        big.model.layers[0].mlp.down_proj.weight[0, 0] = 1e5
    with pytest.raises(ExportError, match="beyond float16's range") as info:
        save_pretrained_gguf(big, tmp_path, tok, "f16", validate_export=False)
    assert "bf16" in info.value.fix and files_in(tmp_path) == []
    result = save_pretrained_gguf(big, tmp_path, tok, "bf16", validate_export=False)
    assert files_in(tmp_path) == ["model.BF16.gguf"] and result.files["bf16"].stat().st_size > 0


def test_cli_reports_errors_as_json(tmp_path, capsys):
    from unsloth.cli import main

    assert main(["export", str(tmp_path / "missing"), "--gguf", "q8_0", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and "is not a model or adapter directory" in report["error"]
    (tmp_path / "run" / "lora").mkdir(parents=True)
    (tmp_path / "run" / "lora" / "adapter_config.json").write_text('{"base_model_name_or_path": "%s"}' % (tmp_path / "gone"))
    assert main(["export", str(tmp_path / "run"), "--gguf", "q8_0", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["error"].startswith(f"could not load {tmp_path / 'run' / 'lora'}") and "merged/" in report["fix"]
    assert main(["export", str(tmp_path), "--gguf", "q4_k_x"]) == 1
    assert "unknown GGUF method 'q4_k_x'" in capsys.readouterr().err
