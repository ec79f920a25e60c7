# python examples/tts-orpheus.py
# Orpheus TTS fine-tuning as the Unsloth notebook does it (needs the model hub and `unsloth[tts]`):
# encode a speech dataset to SNAC tokens, LoRA r=64 on Orpheus 3B in 16 bits, 60 steps, then speak
# a sentence to speech.wav. About 16 GiB of GPU memory.
from datasets import load_dataset
from transformers import Trainer, TrainingArguments

from unsloth import FastLanguageModel, is_bfloat16_supported
from unsloth.training import speech

model, tokenizer = FastLanguageModel.from_pretrained("unsloth/orpheus-3b-0.1-ft", max_seq_length=2048,
                                                     load_in_4bit=False)
model = FastLanguageModel.get_peft_model(
    model, r=64, lora_alpha=64, lora_dropout=0, use_gradient_checkpointing="unsloth",
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])

codec = speech.load_codec(device="cuda")  # hubertsiuzdak/snac_24khz
dataset = load_dataset("MrDragonFox/Elise", split="train")  # columns text, audio
rows = speech.speech_dataset(dataset, tokenizer, codec)

trainer = Trainer(model=model, train_dataset=rows, args=TrainingArguments(
    per_device_train_batch_size=1, gradient_accumulation_steps=4, warmup_steps=5, max_steps=60,
    learning_rate=2e-4, logging_steps=1, optim="adamw_8bit", weight_decay=0.001, lr_scheduler_type="linear",
    seed=3407, output_dir="outputs/orpheus", report_to="none", bf16=is_bfloat16_supported()))
trainer.train()

FastLanguageModel.for_inference(model)
[wave] = speech.generate_speech(model, tokenizer, codec, ["Hey there, my name is Elise <giggles>, nice to meet you."])
speech.write_wav("outputs/orpheus/speech.wav", wave, codec.sampling_rate)
model.save_pretrained("outputs/orpheus/lora")
