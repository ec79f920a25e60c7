"""A tiny random Sesame CSM, saved as the hub's csm-1b is: config (with a tiny Mimi codec), weights,
and a CsmProcessor (a local BPE tokenizer with CSM's special tokens, Encodec's feature extractor).

The codec keeps Mimi's convolution layout (strides 4, 5, 6, 8 and 2: one frame per 1920 samples at
24 kHz), which the processor's default `encoded_length_kwargs` assume; only its widths are tiny.
"""

from __future__ import annotations

import numpy as np
import torch

CODEBOOKS = 4  # codebooks per audio frame
CODEBOOK_SIZE = 32  # the codec's; the model's codebook vocabulary is the same, so every code decodes
SAMPLES_PER_FRAME = 1920
TEXTS = ["the cat sat", "a dog ran far", "hello there", "good morning to you"]

# CSM's layout: "<bos>[speaker]text<eos>" then, for a turn with audio, its frames and the audio end.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ bos_token }}[{{ message['role'] }}]"
    "{%- for item in message['content'] if item['type'] == 'text' -%}{{ item['text'] }}{%- endfor -%}"
    "{{ eos_token }}"
    "{%- for item in message['content'] if item['type'] == 'audio' -%}<|AUDIO|><|audio_eos|>{%- endfor -%}"
    "{%- endfor -%}"
)


def build_tokenizer(texts=TEXTS):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|AUDIO|>", "<|audio_eos|>", "<|PAD|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    # add_special_tokens=True wraps a text in bos ... eos, as csm-1b's tokenizer does
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A <|end_of_text|>",
        special_tokens=[("<|begin_of_text|>", 0), ("<|end_of_text|>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>",
                                   pad_token="<|PAD|>", chat_template=CHAT_TEMPLATE)


def tiny_config(tokenizer, codes: int = CODEBOOK_SIZE):
    """`codes`: the model's code vocabulary (csm-1b's heads have 2051 codes, its codec's codebooks 2048)."""
    from transformers import CsmConfig, MimiConfig

    ids = tokenizer.convert_tokens_to_ids
    codec = MimiConfig(hidden_size=16, num_filters=4, upsample_groups=16, codebook_size=CODEBOOK_SIZE,
                       codebook_dim=8, vector_quantization_hidden_dimension=8, num_quantizers=CODEBOOKS,
                       num_hidden_layers=1, intermediate_size=32, num_attention_heads=2, num_key_value_heads=2,
                       head_dim=8, sliding_window=16, max_position_embeddings=256)
    return CsmConfig(
        num_codebooks=CODEBOOKS, vocab_size=codes, codebook_pad_token_id=codes - 1,
        codebook_eos_token_id=0, text_vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=ids("<|begin_of_text|>"), pad_token_id=ids("<|PAD|>"), audio_token_id=ids("<|AUDIO|>"),
        audio_eos_token_id=ids("<|audio_eos|>"),
        depth_decoder_config=dict(num_codebooks=CODEBOOKS, backbone_hidden_size=64, vocab_size=codes,
                                  hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                  num_key_value_heads=1, max_position_embeddings=CODEBOOKS + 1),
        codec_config=codec.to_dict())


def tiny_csm(seed: int = 0, codes: int = CODEBOOK_SIZE):
    """(model, processor), the model in eval mode with random norm weights (so a wrong norm convention shows)."""
    from transformers import CsmForConditionalGeneration, CsmProcessor, EncodecFeatureExtractor

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = CsmForConditionalGeneration(tiny_config(tokenizer, codes))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and "codec" not in name:
                p.normal_(1.0, 0.3)
    processor = CsmProcessor(EncodecFeatureExtractor(feature_size=1, sampling_rate=24000), tokenizer,
                             chat_template=CHAT_TEMPLATE)
    return model.eval(), processor


def save_tiny_csm(folder, seed: int = 0, codes: int = CODEBOOK_SIZE):
    model, processor = tiny_csm(seed, codes)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return str(folder)


def clip(seconds: float, seed: int = 0) -> np.ndarray:
    """A mono 24 kHz clip (a chirp with some noise), float32."""
    t = np.arange(int(24000 * seconds)) / 24000
    noise = np.random.default_rng(seed).standard_normal(t.size)
    return (0.3 * np.sin(2 * np.pi * (200 + 400 * t) * t) + 0.05 * noise).astype(np.float32)


def training_batch(processor, rows=((0, "the cat sat"), (1, "hello there")), seconds=(0.2, 0.3)):
    """What the notebook's preprocessing returns for rows of (speaker, text) with audio, padded alike."""
    examples = [processor.apply_chat_template(
        [{"role": str(speaker), "content": [{"type": "text", "text": text},
                                             {"type": "audio", "path": clip(length, seed=i)}]}],
        tokenize=True, return_dict=True, output_labels=True,
        text_kwargs={"padding": "max_length", "max_length": 24, "padding_side": "right"},
        audio_kwargs={"sampling_rate": 24000, "max_length": 8000, "padding": "max_length"},
        common_kwargs={"return_tensors": "pt"}) for i, ((speaker, text), length) in enumerate(zip(rows, seconds))]
    keys = ("input_ids", "attention_mask", "labels", "input_values", "input_values_cutoffs")
    return {key: torch.cat([example[key] for example in examples]) for key in keys}
