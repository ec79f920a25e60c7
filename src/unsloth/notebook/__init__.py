"""The notebook facade: the names fine-tuning notebooks import, above the trainer and the export.

    model, tokenizer = FastLanguageModel.from_pretrained("org/model", max_seq_length=2048, load_in_4bit=True)
    model = FastLanguageModel.get_peft_model(model, r=16, use_gradient_checkpointing="unsloth")
    ... TRL's SFTTrainer / GRPOTrainer as usual ...
    model.save_pretrained("lora")                        # adapters (peft)
    model.save_pretrained_merged("merged", tokenizer)    # 16-bit merged weights
"""

from unsloth.logs import show_by_default

show_by_default()  # what the loader says once reaches a notebook that set up no logging
