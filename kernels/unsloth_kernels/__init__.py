from .cross_entropy import fused_linear_cross_entropy
from .lora import LoraWeights, lora_linear, lora_mlp, lora_o, lora_qkv
from .nf4 import dequantize_bnb_4bit, dequantize_nf4
