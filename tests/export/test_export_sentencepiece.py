"""SentencePiece tokenizers (Llama 2, Mistral v0.3, Gemma 3) are exported through llama.cpp's own
converter, which reads their tokenizer.model: a tiny SentencePiece model trained here, wrapped as
transformers wraps the released ones (LlamaTokenizer / GemmaTokenizer from the .model file), a tiny
random model of each family -> save_pretrained_gguf -> llama-cpp-python tokenizes as transformers
does and reproduces its greedy tokens."""

from __future__ import annotations

import pytest

from export_models import CORPUS, greedy_agreement, make_model

TEST_STRING = "Hello world!  Numbers 123 4567, café 我想 🦙\n\tdef f(x): return x"
VOCAB = 384

# family -> (architecture, transformers tokenizer class, special pieces in SentencePiece's id order,
# extra pieces, chat template). Ids as the released tokenizers have them: Llama 2 / Mistral
# <unk> <s> </s>; Gemma <pad> <eos> <bos> <unk>.
FAMILIES = {
    "llama2": ("llama", "LlamaTokenizer", dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1), [],
               "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"),
    "mistral": ("mistral", "LlamaTokenizer", dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1), ["[INST]", "[/INST]"],
                "{{ bos_token }}{% for m in messages %}[INST]{{ m['content'] }}[/INST]{% endfor %}"),
    "gemma3": ("gemma3_text", "GemmaTokenizer",
               dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>"),
               ["<start_of_turn>", "<end_of_turn>"],
               "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
               "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"),
}


def train_sentencepiece(directory, special_ids: dict, extra: list[str], dummy_prefix: bool):
    """A byte-fallback BPE SentencePiece model -> tokenizer.model, with the released models' normalization
    (none: spaces kept as they are; Llama 2 and Mistral prefix a "▁", Gemma does not)."""
    import sentencepiece as spm

    directory.mkdir(parents=True)
    corpus = directory / "corpus.txt"
    corpus.write_text("\n".join(CORPUS * 20), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(directory / "tokenizer"), vocab_size=VOCAB, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, split_digits=True, add_dummy_prefix=dummy_prefix,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        user_defined_symbols=extra, minloglevel=2, **special_ids,
    )
    corpus.unlink()
    (directory / "tokenizer.vocab").unlink()
    return directory / "tokenizer.model"


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    import transformers

    name = request.param
    arch, class_name, special_ids, extra, template = FAMILIES[name]
    folder = tmp_path_factory.mktemp(name) / "tokenizer"
    train_sentencepiece(folder, special_ids, extra, dummy_prefix=name != "gemma3")  # Gemma adds no "▁"
    # reads tokenizer.model, as from the hub; the released tokenizer_config.json files ask for BOS
    tokenizer = getattr(transformers, class_name).from_pretrained(folder, add_bos_token=True)
    tokenizer.chat_template = template
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    model = make_model(arch, vocab_size=len(tokenizer), **ids)
    return name, model, tokenizer


def test_the_tokenizers_are_sentencepiece_and_were_refused_by_our_writer(family):
    import json

    from unsloth.export.errors import ExportError
    from unsloth.export.vocab import pre_tokenizer_name, uses_sentencepiece
    from unsloth.models.tokenizer_files import sentencepiece_model

    _, _, tokenizer = family
    assert uses_sentencepiece(tokenizer) and sentencepiece_model(tokenizer) is not None
    with pytest.raises(ExportError):  # why they must go through llama.cpp's converter
        pre_tokenizer_name(json.loads(tokenizer.backend_tokenizer.to_str()))


def test_merged_save_keeps_the_sentencepiece_model(family, tmp_path):
    """transformers 5 writes only tokenizer.json; the merged folder also gets tokenizer.model, byte for byte."""
    from unsloth.export.merged import save_pretrained_merged
    from unsloth.models.tokenizer_files import sentencepiece_model

    _, model, tokenizer = family
    save_pretrained_merged(model, str(tmp_path), tokenizer)
    assert (tmp_path / "tokenizer.model").read_bytes() == sentencepiece_model(tokenizer).read_bytes()
    assert (tmp_path / "tokenizer.json").is_file()


@pytest.mark.slow
def test_sentencepiece_family_exports_and_matches_transformers(family, tmp_path):
    from unsloth.export import runtime
    from unsloth.export.gguf import save_pretrained_gguf

    name, model, tokenizer = family
    result = save_pretrained_gguf(model, tmp_path, tokenizer, "f16")
    report = result.validations["f16"]
    assert report.passed and report.tokenizer_mismatches == [], report.summary()
    assert [p.name for p in tmp_path.iterdir()] == ["model.F16.gguf"]  # the merged folder is gone

    llm = runtime.load(result.files["f16"], n_ctx=128, gpu=False)
    try:
        ids = tokenizer(TEST_STRING)["input_ids"]  # the validation above also compared its own samples
        assert llm.tokenize(TEST_STRING.encode(), add_bos=True, special=True) == ids, name
        assert llm.detokenize(ids).decode().strip() == TEST_STRING.strip()
        agree, total, seen, _ = greedy_agreement(model, llm, tokenizer)
    finally:
        llm.close()
    assert agree >= 0.75 * total, (name, agree, total)
    assert len(seen) > 4, "the model is degenerate; the comparison would prove nothing"


def test_sentencepiece_tokenizer_without_its_model_file_is_refused_before_any_file(family, tmp_path):
    """Reloaded from a folder transformers 5 saved (tokenizer.json only) once the .model file is gone."""
    import shutil

    from transformers import AutoTokenizer

    from unsloth.export.errors import ExportError
    from unsloth.export.gguf import save_pretrained_gguf
    from unsloth.models.tokenizer_files import sentencepiece_model

    _, model, tokenizer = family
    shutil.copytree(sentencepiece_model(tokenizer).parent, tmp_path / "hub")
    AutoTokenizer.from_pretrained(tmp_path / "hub").save_pretrained(tmp_path / "saved")  # no tokenizer.model
    shutil.rmtree(tmp_path / "hub")
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "saved")
    assert sentencepiece_model(reloaded) is None
    out = tmp_path / "out"
    with pytest.raises(ExportError, match="tokenizer.model") as caught:
        save_pretrained_gguf(model, out, reloaded, "f16")
    assert "nothing was written" in str(caught.value) and "from_pretrained" in caught.value.fix
    assert not out.exists()
