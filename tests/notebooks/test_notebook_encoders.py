"""The encoder notebooks that load through FastModel with `auto_model`, their cells as written on tiny random
models: Whisper.ipynb (WhisperForConditionalGeneration, LoRA with task_type=None, transformers'
Seq2SeqTrainer given `tokenizer=`, the ASR pipeline, LoRA and merged saves) and bert_classification.ipynb
(ModernBERT through AutoModelForSequenceClassification with full_finetuning=True, Trainer, the
sentiment pipeline). Audio is random noise at 16 kHz (the notebook's dataset is on the hub)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from tiny_notebook_models import CORPUS

TEXTS = ["the quick brown fox", "the lazy dog", "name the capital of france", "paris is the capital"]
WHISPER_SPECIALS = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|fr|>", "<|translate|>", "<|transcribe|>",
                    "<|startofprev|>", "<|nocaptions|>", "<|notimestamps|>"]


def write_tiny_whisper(folder) -> str:
    """A tiny random Whisper (16 mel bins, 1 s windows) with a byte-level BPE Whisper tokenizer and the
    generation config Whisper's generate reads (language and task ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import (GenerationConfig, WhisperConfig, WhisperFeatureExtractor,
                              WhisperForConditionalGeneration, WhisperProcessor, WhisperTokenizer)

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(CORPUS * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    saved = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in saved["merges"]]
    tokenizer = WhisperTokenizer(vocab=saved["vocab"], merges=merges, pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": WHISPER_SPECIALS[1:]})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in WHISPER_SPECIALS}
    end = ids["<|endoftext|>"]
    features = WhisperFeatureExtractor(feature_size=16, sampling_rate=16000, chunk_length=1, n_fft=400, hop_length=160)
    config = WhisperConfig(vocab_size=len(tokenizer), num_mel_bins=16, d_model=32, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                           max_source_positions=50, max_target_positions=64, pad_token_id=end, bos_token_id=end,
                           eos_token_id=end, decoder_start_token_id=ids["<|startoftranscript|>"])
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(config)
    model.generation_config = GenerationConfig(
        decoder_start_token_id=ids["<|startoftranscript|>"], eos_token_id=end, pad_token_id=end, bos_token_id=end,
        max_length=16, is_multilingual=True, lang_to_id={"<|en|>": ids["<|en|>"], "<|fr|>": ids["<|fr|>"]},
        task_to_id={"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]},
        no_timestamps_token_id=ids["<|notimestamps|>"], prev_sot_token_id=ids["<|startofprev|>"])
    model.save_pretrained(folder)
    WhisperProcessor(feature_extractor=features, tokenizer=tokenizer).save_pretrained(folder)
    return str(folder)


@dataclass
class DataCollatorSpeechSeq2SeqWithPadding:  # the notebook's collator, as written
    processor: Any

    def __call__(self, features):
        input_features = [{"input_features": feature["input_features"]} for feature in features]
        batch = self.processor.feature_extractor.pad(input_features, return_tensors="pt")
        label_features = [{"input_ids": feature["labels"]} for feature in features]
        labels_batch = self.processor.tokenizer.pad(label_features, return_tensors="pt")
        labels = labels_batch["input_ids"].masked_fill(labels_batch.attention_mask.ne(1), -100)
        if (labels[:, 0] == self.processor.tokenizer.bos_token_id).all().cpu().item():
            labels = labels[:, 1:]
        batch["labels"] = labels
        return batch


@pytest.mark.slow
def test_whisper_notebook(tmp_path):
    from unsloth import FastModel
    from transformers import WhisperForConditionalGeneration

    model, tokenizer = FastModel.from_pretrained(
        model_name=write_tiny_whisper(tmp_path / "whisper-large-v3"), dtype=None, load_in_4bit=False,
        auto_model=WhisperForConditionalGeneration, whisper_language="English", whisper_task="transcribe")
    prefix = tokenizer.tokenizer.convert_tokens_to_ids(["<|startoftranscript|>", "<|en|>", "<|transcribe|>",
                                                         "<|notimestamps|>"])
    assert tokenizer.tokenizer("the lazy dog").input_ids[:4] == prefix  # labels carry the language and task
    model = FastModel.get_peft_model(model, r=64, target_modules=["q_proj", "v_proj"], lora_alpha=64, lora_dropout=0,
                                     bias="none", use_gradient_checkpointing="unsloth", random_state=3407,
                                     use_rslora=False, loftq_config=None, task_type=None)
    model.generation_config.language = "<|en|>"
    model.generation_config.task = "transcribe"
    model.config.suppress_tokens = []
    model.generation_config.forced_decoder_ids = None

    rng = np.random.default_rng(0)
    rows = [{"audio": {"array": rng.standard_normal(6000 + 1000 * i).astype(np.float32) * 0.1, "sampling_rate": 16000},
             "text": text} for i, text in enumerate(TEXTS * 2)]

    def formatting_prompts_func(example):
        audio = example["audio"]
        features = tokenizer.feature_extractor(audio["array"], sampling_rate=audio["sampling_rate"])
        return {"input_features": features.input_features[0], "labels": tokenizer.tokenizer(example["text"]).input_ids}

    train_dataset = [formatting_prompts_func(example) for example in rows[:6]]
    test_dataset = [formatting_prompts_func(example) for example in rows[6:]]

    def compute_metrics(pred):  # the notebook's, with exact match in place of evaluate's WER (from the hub)
        label_ids = pred.label_ids
        label_ids[label_ids == -100] = tokenizer.pad_token_id  # a processor answering for its tokenizer
        pred_str = tokenizer.batch_decode(np.argmax(pred.predictions[0], axis=-1), skip_special_tokens=True)
        label_str = tokenizer.batch_decode(label_ids, skip_special_tokens=True)
        return {"wer": 100 * float(np.mean([p != t for p, t in zip(pred_str, label_str)]))}

    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments
    from unsloth import is_bf16_supported

    trainer = Seq2SeqTrainer(
        model=model, train_dataset=train_dataset, eval_dataset=test_dataset,
        data_collator=DataCollatorSpeechSeq2SeqWithPadding(processor=tokenizer),
        tokenizer=tokenizer.feature_extractor, compute_metrics=compute_metrics,
        args=Seq2SeqTrainingArguments(
            per_device_train_batch_size=1, gradient_accumulation_steps=2, warmup_steps=1, max_steps=3,
            learning_rate=1e-3, logging_steps=1, optim="adamw_8bit", fp16=False, bf16=is_bf16_supported(),
            weight_decay=0.001, remove_unused_columns=False, lr_scheduler_type="linear", label_names=["labels"],
            eval_steps=3, eval_strategy="steps", seed=3407, output_dir=str(tmp_path / "outputs"), report_to="none"))
    assert trainer.processing_class is tokenizer.feature_extractor
    trainer.train()
    assert "eval_wer" in trainer.state.log_history[-2]

    from transformers import pipeline

    FastModel.for_inference(model)
    model.eval()
    whisper = pipeline("automatic-speech-recognition", model=model, tokenizer=tokenizer.tokenizer,
                       feature_extractor=tokenizer.feature_extractor, processor=tokenizer, return_language=True)
    transcribed = whisper({"raw": rows[0]["audio"]["array"], "sampling_rate": 16000})
    assert isinstance(transcribed["text"], str) and transcribed["chunks"][0]["language"] == "english"

    model.save_pretrained(tmp_path / "whisper_lora")
    tokenizer.save_pretrained(tmp_path / "whisper_lora")
    assert (tmp_path / "whisper_lora" / "adapter_model.safetensors").is_file()
    model.save_pretrained_merged(str(tmp_path / "whisper_finetune_16bit"), tokenizer, save_method=None)
    plain = WhisperForConditionalGeneration.from_pretrained(tmp_path / "whisper_finetune_16bit").eval()
    batch = DataCollatorSpeechSeq2SeqWithPadding(tokenizer)(test_dataset)
    with torch.no_grad():
        torch.testing.assert_close(plain(**batch).loss, model(**batch).loss)  # the trained LoRA, merged


@pytest.mark.slow
def test_bert_classification_notebook(tmp_path):
    from transformers import (AutoModelForSequenceClassification, BertTokenizerFast, ModernBertConfig,
                              ModernBertModel, Trainer, TrainingArguments, pipeline)

    folder = tmp_path / "ModernBERT-large"
    folder.mkdir()
    words = sorted({w for t in TEXTS for w in t.split()})
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    tok = BertTokenizerFast(vocab_file=str(folder / "vocab.txt"), model_input_names=["input_ids", "attention_mask"])
    torch.manual_seed(0)
    ModernBertModel(ModernBertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=64, pad_token_id=0, cls_token_id=2,
                                     sep_token_id=3, bos_token_id=2, eos_token_id=3)).save_pretrained(folder)
    tok.save_pretrained(folder)

    from unsloth import FastModel

    id2label = {0: "sadness", 1: "joy", 2: "love", 3: "anger", 4: "fear", 5: "surprise"}
    label2id = {v: k for k, v in id2label.items()}
    model, tokenizer = FastModel.from_pretrained(
        model_name=str(folder), auto_model=AutoModelForSequenceClassification, max_seq_length=2048, dtype=None,
        num_labels=6, full_finetuning=True, id2label=id2label, label2id=label2id, load_in_4bit=False)
    full = FastModel.get_peft_model(
        model, r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        lora_alpha=16, lora_dropout=0, bias="none", use_gradient_checkpointing="unsloth", random_state=3407,
        use_rslora=False, loftq_config=None, task_type="SEQ_CLS")
    assert full is model and all(p.requires_grad for p in model.parameters())  # full fine-tuning: no adapters

    from datasets import Dataset

    dataset = Dataset.from_dict({"text": TEXTS * 4, "label": [i % 6 for i in range(16)]})
    dataset = dataset.train_test_split(test_size=0.25)
    train_dataset = dataset["train"].map(lambda examples: tokenizer(examples["text"]), batched=True)
    val_dataset = dataset["test"].map(lambda examples: tokenizer(examples["text"]), batched=True)
    train_dataset = train_dataset.rename_column("label", "labels")
    val_dataset = val_dataset.rename_column("label", "labels")

    def compute_metrics(eval_pred):
        logits, labels = eval_pred
        return {"accuracy": float((logits.argmax(axis=-1) == labels).mean())}

    before = model.classifier.weight.detach().clone()
    trainer = Trainer(
        model=model, processing_class=tokenizer, eval_dataset=val_dataset, train_dataset=train_dataset,
        args=TrainingArguments(per_device_train_batch_size=4, gradient_accumulation_steps=1, warmup_steps=1,
                               num_train_epochs=1, learning_rate=5e-4, fp16=False, bf16=False, logging_steps=1,
                               optim="adamw_8bit", weight_decay=0.001, eval_strategy="steps", eval_steps=0.5,
                               lr_scheduler_type="linear", seed=3407, output_dir=str(tmp_path / "outputs"),
                               report_to="none"),
        compute_metrics=compute_metrics)
    trainer.train()
    assert any("eval_accuracy" in r for r in trainer.state.log_history)
    assert not torch.equal(model.classifier.weight, before)

    classifier = pipeline("sentiment-analysis", model=model, tokenizer=tokenizer)
    assert classifier("the quick brown fox")[0]["label"] in label2id
    model.save_pretrained(tmp_path / "bert_classification_lora")
    tokenizer.save_pretrained(tmp_path / "bert_classification_lora")
    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "bert_classification_lora")
    assert reloaded.config.id2label[1] == "joy"
    torch.testing.assert_close(reloaded.classifier.weight, model.classifier.weight)

    # the same notebook with LoRA (full_finetuning=False): peft's classification wrapper, the head trained whole
    model, _ = FastModel.from_pretrained(model_name=str(folder), auto_model=AutoModelForSequenceClassification,
                                         num_labels=6, load_in_4bit=False)
    model = FastModel.get_peft_model(model, r=4, target_modules=["Wqkv", "Wo", "Wi"], task_type="SEQ_CLS")
    assert type(model).__name__ == "PeftModelForSequenceClassification"
    assert any("classifier" in n and p.requires_grad for n, p in model.named_parameters())
