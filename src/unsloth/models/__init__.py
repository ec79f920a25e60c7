"""The trainer's model side: FastLanguageModel (load, LoRA, save) and the per-family kernel patches."""
