from .activations import geglu, swiglu
from .cross_entropy import fused_linear_cross_entropy
from .layer_norm import LayerNorm, layer_norm
from .lora import LoraWeights, lora_linear, lora_mlp, lora_o, lora_qkv
from .nf4 import dequantize_bnb_4bit, dequantize_nf4
from .rms_norm import RMSNorm, rms_norm
from .rope import apply_rope
