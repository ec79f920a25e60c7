"""Embedding models through sentence-transformers: tiny random BERT and Qwen3 encoders, LoRA through
FastSentenceTransformer, a few MultipleNegativesRankingLoss steps, a merged save in the
sentence-transformers layout that plain SentenceTransformer reloads with equal embeddings."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

st = pytest.importorskip("sentence_transformers")

PAIRS = [("a man plays guitar", "someone makes music"), ("the dog runs in the park", "an animal is outside"),
         ("two kids eat ice cream", "children have a snack"), ("a woman reads a book", "a person is reading"),
         ("the car is red", "a vehicle has a colour"), ("rain falls on the city", "the weather is wet"),
         ("he cooks pasta", "a meal is being made"), ("birds fly south", "animals migrate")]
WORDS = sorted({w for pair in PAIRS for text in pair for w in text.split()})


def write_tiny_bert(folder):
    from transformers import BertConfig, BertModel, BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = BertTokenizerFast(vocab_file=str(folder / "vocab.txt"))
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    BertModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def write_tiny_qwen3(folder):
    from transformers import Qwen3Config, Qwen3Model

    from unsloth.training.demo import build_tokenizer

    tokenizer = build_tokenizer([" ".join(p) for p in PAIRS], vocab_size=300)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    Qwen3Model(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _train(model, steps: int, tmp_path, pairs=PAIRS):
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments, losses

    data = Dataset.from_dict({"anchor": [a for a, _ in pairs], "positive": [p for _, p in pairs]})
    trainer = SentenceTransformerTrainer(
        model=model, train_dataset=data, loss=losses.MultipleNegativesRankingLoss(model),
        args=SentenceTransformerTrainingArguments(
            output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=len(pairs), learning_rate=5e-3,
            logging_steps=1, report_to="none", save_strategy="no", seed=0, use_cpu=True))
    trainer.train()
    return [r["loss"] for r in trainer.state.log_history if "loss" in r]


def _check_merged_reload(model, tmp_path):
    texts = [a for a, _ in PAIRS]
    model.eval()
    expected = model.encode(texts, convert_to_numpy=True)
    folder = tmp_path / "merged"
    model.save_pretrained_merged(str(folder))
    modules = json.loads((folder / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[-1] for m in modules][:2] == ["Transformer", "Pooling"]
    encoder_folder = folder / modules[0]["path"]
    assert (encoder_folder / "config.json").is_file() and (encoder_folder / "model.safetensors").is_file()
    assert not (encoder_folder / "adapter_config.json").exists()  # merged: no peft needed to load it
    plain = st.SentenceTransformer(str(folder), device="cpu")
    assert not hasattr(plain[0].auto_model, "peft_config")
    got = plain.encode(texts, convert_to_numpy=True)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    return plain


@pytest.mark.slow
def test_bert_lora_contrastive_training_and_merged_reload(tmp_path):
    from unsloth import FastSentenceTransformer

    model = FastSentenceTransformer.from_pretrained(write_tiny_bert(tmp_path / "bert"), max_seq_length=32,
                                                    dtype=torch.float32, load_in_4bit=False, full_finetuning=False)
    assert isinstance(model, st.SentenceTransformer)
    before = model.encode(["a man plays guitar"], convert_to_numpy=True)
    model = FastSentenceTransformer.get_peft_model(model, r=8, lora_alpha=16,
                                                   target_modules=["query", "key", "value", "dense"],
                                                   task_type="FEATURE_EXTRACTION", use_gradient_checkpointing=True)
    report = model[0].auto_model.get_base_model()._unsloth_patches
    assert report.checkpointed == 2  # our per-layer checkpointing, on the encoder's layers
    assert report.generic_only  # BERT: no family patches; its LoRA layers run our fused path
    assert report.lora["linear"] == 2 * 6 + 1  # q, k, v, attention out, intermediate, out per layer; the pooler
    losses = _train(model, steps=6, tmp_path=tmp_path)
    assert len(losses) == 6 and losses[-1] < losses[0]
    plain = _check_merged_reload(model, tmp_path)
    assert not np.allclose(plain.encode(["a man plays guitar"], convert_to_numpy=True), before, atol=1e-4)


@pytest.mark.slow
def test_qwen3_embedding_decoder_gets_family_patches_and_lasttoken_pooling(tmp_path):
    from unsloth import FastSentenceTransformer

    model = FastSentenceTransformer.from_pretrained(write_tiny_qwen3(tmp_path / "qwen3"), max_seq_length=16,
                                                    dtype="float32", pooling_mode="lasttoken")
    assert model[1].pooling_mode == "lasttoken"
    model = FastSentenceTransformer.get_peft_model(model, r=8, lora_alpha=16)  # all linear layers
    report = model[0].auto_model.get_base_model()._unsloth_patches
    assert report.generic_only is None and report.rms_norm and report.mlp == 2 and report.rope
    assert report.lora == {"MLP": 2, "linear": 2 * 4}  # the fused LoRA MLP; q, k, v, o
    # Qwen3's kernels under the CPU interpreter are slow: a small batch, few steps
    losses = _train(model, steps=3, tmp_path=tmp_path, pairs=PAIRS[:4])
    assert losses[-1] < losses[0]
    plain = _check_merged_reload(model, tmp_path)
    assert plain[1].pooling_mode == "lasttoken"


def test_push_to_hub_merged_is_there_and_refuses_offline_before_writing(tmp_path, monkeypatch):
    from unsloth import FastSentenceTransformer
    from unsloth.notebook.hub import HubError

    model = FastSentenceTransformer.from_pretrained(write_tiny_bert(tmp_path / "bert"), dtype=torch.float32)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubError, match="HF_HUB_OFFLINE is set"):
        model.push_to_hub_merged("me/bert_finetune_16bit", tokenizer=model.tokenizer, save_method="merged_16bit")


def test_a_bad_pooling_mode_is_refused_before_loading(tmp_path):
    from unsloth import FastSentenceTransformer

    with pytest.raises(ValueError, match="pooling_mode 'avg' is not one of mean"):
        FastSentenceTransformer.from_pretrained(str(tmp_path / "missing"), pooling_mode="avg")


@pytest.mark.slow
def test_lora_save_keeps_adapters_that_sentence_transformers_reloads(tmp_path):
    from unsloth import FastSentenceTransformer

    model = FastSentenceTransformer.from_pretrained(write_tiny_bert(tmp_path / "bert"), dtype=torch.float32)
    model = FastSentenceTransformer.get_peft_model(model, r=4, init_lora_weights=False)  # adapters that change it
    model.eval()
    expected = model.encode(["a man plays guitar"], convert_to_numpy=True)
    model.save_pretrained_merged(str(tmp_path / "lora"), save_method="lora")
    assert (tmp_path / "lora" / "adapter_config.json").is_file() and (tmp_path / "lora" / "modules.json").is_file()
    reloaded = st.SentenceTransformer(str(tmp_path / "lora"), device="cpu")
    np.testing.assert_allclose(reloaded.encode(["a man plays guitar"], convert_to_numpy=True), expected,
                               rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="'merged_16bit' or 'lora'"):
        model.save_pretrained_merged(str(tmp_path / "gguf"), save_method="merged_4bit")
