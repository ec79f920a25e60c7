"""Vision-language GGUF export: the language model's GGUF plus llama.cpp's projector file (mmproj),
both validated, then `unsloth generate/chat --image` on them. Tiny random Qwen2.5-VL, Qwen3-VL and
Gemma 3 models with a byte-level tokenizer llama.cpp reads; Gemma 3 saved in its released layout
(vision_tower.vision_model.*, which llama.cpp's converter reads; transformers 5 writes it without
vision_model.); Gemma 4 with a SentencePiece-style tokenizer (the only kind its converter reads)."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))  # the tiny vision families

from export_models import make_spm_tokenizer  # noqa: E402
from tiny_vision import (add_audio_tower, build_processor, family_tokens, images, save_tiny_vision,  # noqa: E402
                         vision_config)

pytest.importorskip("PIL")
pytestmark = pytest.mark.slow  # exports through llama.cpp's converter and runs llama.cpp

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "gemma3", "gemma4")


def save_exportable(family: str, directory: Path) -> str:
    """A tiny model of `family` llama.cpp can convert: 4 vision blocks for the Qwens (their merger's
    names need more blocks than 2), Gemma 3's attention scale and no SigLIP pooling head, as released."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForImageTextToText

    if family == "gemma4":
        processor = build_processor(family, tokenizer=make_spm_tokenizer(*family_tokens(family)))
    else:
        processor = build_processor(family, byte_level=True)
    config = vision_config(family, processor.tokenizer)
    if family.startswith("qwen"):
        config.vision_config.depth = 4
        if family == "qwen2_5_vl":
            config.vision_config.fullatt_block_indexes = [1, 3]
    elif family == "gemma3":
        config.text_config.query_pre_attn_scalar = config.text_config.head_dim
        config.vision_config.vision_use_head = False
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.any() and "bias" not in name:  # Gemma's projection starts at zero: open it
                p.normal_(0.0, 0.5)
    if family == "gemma4":  # as E2B / E4B ship: an audio tower too, which the projector file also holds
        model = _with_audio_tower(model, processor.tokenizer)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    if family == "gemma3":
        weights = Path(directory) / "model.safetensors"
        state = {("vision_tower.vision_model." + k.removeprefix("vision_tower.") if k.startswith("vision_tower.")
                  else k): v for k, v in load_file(weights).items()}
        save_file(state, weights, metadata={"format": "pt"})
    return str(directory)


def _with_audio_tower(model, tokenizer):
    """A Gemma 4 like `model` (the same weights) with a tiny audio tower beside its vision tower."""
    from transformers import AutoModelForImageTextToText

    with_audio = AutoModelForImageTextToText.from_config(add_audio_tower(model.config, tokenizer), dtype=torch.float32)
    missing = with_audio.load_state_dict(model.state_dict(), strict=False).missing_keys
    assert missing and all("audio" in name for name in missing)
    return with_audio


@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_gguf_writes_the_model_and_its_projector(family, tmp_path, monkeypatch):
    """The notebook call on a LoRA model: the text GGUF (its f16 reference token-exact against
    transformers), and mmproj-*.gguf holding the whole vision tower (and Gemma 4's audio tower), loaded beside it by llama.cpp
    with an image run through both where llama-cpp-python has its multimodal library."""
    import gguf

    from unsloth import FastVisionModel
    from unsloth.export import runtime

    monkeypatch.setenv("UNSLOTH_KERNELS", "0")
    model, processor = FastVisionModel.from_pretrained(save_exportable(family, tmp_path / "base"), load_in_4bit=False,
                                                       dtype="float32")
    model = FastVisionModel.get_peft_model(model, r=4, lora_alpha=8, init_lora_weights=False)
    # q8_0 (quantized from the f16): the CLI test below
    result = model.save_pretrained_gguf(str(tmp_path / "gguf"), processor, quantization_method="f16")
    assert set(result.files) == {"f16", "mmproj"} and result.files["mmproj"].name == "mmproj-model.F16.gguf"
    assert result.validations["f16"].passed
    check = result.validations["mmproj"]
    assert check.passed and check.weights == check.expected_weights and check.blocks == check.expected_blocks
    assert check.file == str(result.files["mmproj"]) and check.projector_type  # gemma4v, qwen2.5vl_merger, ...
    if runtime.multimodal_available():
        assert check.image_tokens > 0 and check.reply_tokens > 0, check.summary()
    reader = gguf.GGUFReader(str(result.files["mmproj"]))
    assert reader.fields["general.architecture"].contents() == "clip"
    assert reader.fields["clip.has_vision_encoder"].contents() is True
    if family == "gemma4":  # its audio tower's weights are counted in the check above
        assert reader.fields["clip.has_audio_encoder"].contents() is True
    assert sorted(p.name for p in (tmp_path / "gguf").iterdir()) == ["Modelfile", "mmproj-model.F16.gguf",
                                                                     "model.F16.gguf"]
    # the Modelfile is the language model's, its turns from the processor's chat template
    assert (tmp_path / "gguf" / "Modelfile").read_text().startswith("FROM ./model.F16.gguf")
    assert "TEMPLATE" in (tmp_path / "gguf" / "Modelfile").read_text()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """`unsloth export` of a tiny Qwen2.5-VL checkpoint folder: (output folder, JSON report)."""
    from unsloth.cli import main

    root = tmp_path_factory.mktemp("vision-export")
    checkpoint = save_exportable("qwen2_5_vl", root / "merged")
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = main(["export", checkpoint, "--gguf", "q8_0", "--out", str(root / "gguf"), "--json"])
    report = json.loads(buffer.getvalue())
    assert code == 0, report
    return root / "gguf", report


def test_unsloth_export_of_a_vision_checkpoint(exported):
    out, report = exported
    assert set(report["files"]) == {"q8_0", "mmproj"}
    assert report["validation"]["mmproj"]["passed"] and report["validation"]["f16"]["passed"]


def test_generate_and_chat_with_an_image(exported, tmp_path, capsys, monkeypatch):
    from unsloth.cli import main
    from unsloth.export import runtime

    if not runtime.multimodal_available():
        pytest.skip("this llama-cpp-python has no multimodal library (mtmd)")
    out, _ = exported
    picture = tmp_path / "picture.png"
    images(1)[0].save(picture)
    prompt = "What is in this picture?"
    assert main(["generate", str(out), prompt, "--image", str(picture), "--json", "--max-tokens", "4", "--cpu"]) == 0
    with_image = json.loads(capsys.readouterr().out)
    assert main(["generate", str(out), prompt, "--json", "--max-tokens", "4", "--cpu"]) == 0
    without = json.loads(capsys.readouterr().out)
    assert with_image["ok"] and with_image["completion_tokens"] > 0
    assert with_image["prompt_tokens"] > without["prompt_tokens"]  # the image's tokens went in
    monkeypatch.setattr("sys.stdin", io.StringIO("t5 t6\nt7\n"))
    assert main(["chat", str(out), "--image", str(picture), "--max-tokens", "3", "--cpu"]) == 0
    captured = capsys.readouterr()
    assert "about" in captured.err and captured.out.strip()


def test_what_cannot_take_an_image_says_so(exported, tmp_path, capsys):
    """A GGUF with no projector beside it, a checkpoint folder, a missing picture, --raw: each refused
    with the fix, nothing run."""
    import shutil

    from unsloth.cli import main

    out, report = exported
    picture = tmp_path / "picture.png"
    images(1)[0].save(picture)
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(report["files"]["q8_0"], alone)
    checkpoint = save_tiny_vision("qwen2_5_vl", tmp_path / "checkpoint")
    for argv, says in ((["generate", str(alone), "hi", "--image", str(picture)], "no projector file"),
                       (["generate", checkpoint, "hi", "--image", str(picture)], "checkpoint folder"),
                       (["generate", str(out), "hi", "--image", str(tmp_path / "none.png")], "no such file"),
                       (["generate", str(out), "hi", "--image", str(picture), "--raw"], "--raw")):
        assert main(argv) != 0
        assert says in capsys.readouterr().err


def test_a_vision_model_llama_cpp_cannot_run_is_refused_before_any_file(tmp_path):
    """Llama 3.2 Vision (mllama): llama.cpp has no converter class for it; named, nothing written."""
    from unsloth.export import ExportError
    from unsloth.export.gguf import save_pretrained_gguf
    from tiny_vision import tiny_vision_model

    model, processor = tiny_vision_model("mllama")
    with pytest.raises(ExportError, match="MllamaForConditionalGeneration"):
        save_pretrained_gguf(model, tmp_path / "gguf", processor, "f16")
    assert not (tmp_path / "gguf").exists()


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3"])
def test_merged_save_names_the_weights_as_save_pretrained_does(family, tmp_path):
    """Vision-language models rename checkpoint keys on load (transformers 4 by a key mapping, 5 by its
    weight conversions); the merged save writes the names the model's own save_pretrained writes, on
    either end of the window."""
    from peft import LoraConfig, get_peft_model
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText

    from unsloth.export.merged import save_pretrained_merged
    from tiny_vision import build_tokenizer

    model = AutoModelForImageTextToText.from_config(vision_config(family, build_tokenizer(family)))
    model.save_pretrained(tmp_path / "plain")
    lora = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    save_pretrained_merged(lora, str(tmp_path / "merged"))

    def names(folder):
        return {k for f in folder.glob("*.safetensors") for k in safe_open(f, "pt").keys()}

    assert names(tmp_path / "merged") == names(tmp_path / "plain")
