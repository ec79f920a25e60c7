"""Training: configs for `unsloth train`, the SFT and GRPO runners, memory (checkpointing, offload), the demo."""
