# python examples/embeddings-minilm.py
# Embedding-model fine-tuning as the Unsloth notebook does it (needs the model hub and
# `unsloth[embeddings]`): LoRA on all-MiniLM-L6-v2, MultipleNegativesRankingLoss on NLI pairs, then a
# merged save in the sentence-transformers layout that plain SentenceTransformer loads.
from datasets import load_dataset
from sentence_transformers import (SentenceTransformer, SentenceTransformerTrainer,
                                   SentenceTransformerTrainingArguments, losses)
from sentence_transformers.training_args import BatchSamplers

from unsloth import FastSentenceTransformer, is_bf16_supported

model = FastSentenceTransformer.from_pretrained("unsloth/all-MiniLM-L6-v2", max_seq_length=512)
model = FastSentenceTransformer.get_peft_model(model, r=64, lora_alpha=128,
                                               target_modules=["query", "key", "value", "dense"])
dataset = load_dataset("sentence-transformers/all-nli", "pair", split="train[:100000]")  # anchor, positive

trainer = SentenceTransformerTrainer(
    model=model, train_dataset=dataset, loss=losses.MultipleNegativesRankingLoss(model),
    args=SentenceTransformerTrainingArguments(
        output_dir="outputs/minilm", num_train_epochs=1, per_device_train_batch_size=256, learning_rate=2e-4,
        warmup_ratio=0.03, logging_steps=50, report_to="none", bf16=is_bf16_supported(),
        fp16=not is_bf16_supported(), batch_sampler=BatchSamplers.NO_DUPLICATES))
trainer.train()

model.save_pretrained_merged("outputs/minilm/merged")
reloaded = SentenceTransformer("outputs/minilm/merged")
print(reloaded.similarity(reloaded.encode(["A soccer player runs"]), reloaded.encode(["An athlete plays"])))
