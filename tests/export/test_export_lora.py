"""A LoRA adapter checkpoint: export merges the adapters (the result differs from the base model and
matches the merged model), leaves the user's model untouched, and k-quants work on tiny dims."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from export_models import make_model

pytestmark = pytest.mark.slow  # exports and runs models through llama.cpp

DIMS = dict(hidden_size=128, intermediate_size=344)  # the demo model's shape: rows not a multiple of 256
PROMPTS = ("The capital of France is", "def add(a, b):", "Once upon a time")


def lora_model(base_dir):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,  # random B: the adapter changes outputs
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(make_model("llama", **DIMS), config)
    model.peft_config["default"].base_model_name_or_path = str(base_dir)
    return model.eval()


@pytest.fixture(scope="module")
def adapter_export(tmp_path_factory):
    from export_models import make_tokenizer
    from unsloth.cli import main

    tokenizer = make_tokenizer()
    root = tmp_path_factory.mktemp("lora")
    make_model("llama", **DIMS).save_pretrained(root / "base")
    model = lora_model(root / "base")
    model.save_pretrained(root / "run" / "lora")  # the layout `unsloth train` writes
    tokenizer.save_pretrained(root / "run" / "lora")
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = main(["export", str(root / "run"), "--gguf", "f16", "--gguf", "q4_k_m", "--modelfile", "--json"])
    report = json.loads(buffer.getvalue())
    assert code == 0, report
    return model, tokenizer, report, root / "run-gguf"


def _greedy_hf(model, ids):
    from unsloth.export.validate import reference_greedy

    return reference_greedy(model, ids, 12)[0]


def test_adapter_is_merged(adapter_export, tmp_path):
    from unsloth.export import runtime

    model, tokenizer, report, _ = adapter_export
    assert report["ok"] and report["validation"]["f16"]["passed"]
    base = make_model("llama", **DIMS)
    llm = runtime.load(report["files"]["f16"], n_ctx=64, gpu=False)
    differs = 0
    try:
        for prompt in PROMPTS:
            ids = tokenizer(prompt)["input_ids"]
            got = runtime.greedy(llm, ids, 12)
            with torch.no_grad():
                assert got[:4] == _greedy_hf(model, ids)[:4]  # the adapter model (f16 merge: the first tokens)
            differs += got != _greedy_hf(base, ids)
    finally:
        llm.close()
    assert differs, "the export looks like the base model: the adapter was not merged"


def test_k_quant_on_tiny_rows_and_modelfile(adapter_export):
    _, _, report, out = adapter_export
    q4 = report["validation"]["q4_k_m"]
    assert q4["threshold"] == 0.6 and q4["agreement"] >= 0.6 and q4["passed"], q4  # k-quant fallbacks still agree
    modelfile = (out / "Modelfile").read_text()
    assert sorted(p.name for p in out.iterdir()) == ["Modelfile", "run.F16.gguf", "run.Q4_K_M.gguf"]
    assert modelfile.startswith("FROM ./run.F16.gguf\n")
    assert '{{ if eq .Role "user" }}<|im_start|>user\n{{ .Content }}<|im_end|>\n' in modelfile
    assert 'PARAMETER stop "<|im_end|>"' in modelfile


def test_save_pretrained_gguf_leaves_the_model_untouched(tmp_path):
    from export_models import make_tokenizer
    from peft.tuners.lora import LoraLayer

    from unsloth.export.gguf import save_pretrained_gguf

    model = lora_model(tmp_path / "unused")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = save_pretrained_gguf(model, tmp_path / "out", make_tokenizer(), "q8_0")
    assert list(result.files) == ["q8_0"] and sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.Q8_0.gguf"]
    assert result.validations["f16"].passed  # the reference was checked, then removed
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert not any(m.merged for m in model.modules() if isinstance(m, LoraLayer))
