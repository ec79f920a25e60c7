"""Tiny random vision-language models of each family we test, with a processor built here.

Each family: its own config classes at toy sizes (hidden 64, 2 text layers, a 2-block vision tower),
a word-level tokenizer of the text vocab plus the family's special tokens, the family's slow (PIL)
image processor constructed from keyword arguments, and a chat template shaped like the family's.
Images are 32x32 RGB.
"""

from __future__ import annotations

import torch

WORDS = 300
IMAGE_SIZE = 32
VISION_FAMILIES = ("qwen2_5_vl", "qwen3_vl", "gemma3", "gemma4", "mllama")

TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)

_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_GEMMA = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}{{ IMAGE }}{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
_LLAMA = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|image|>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

# family -> (special tokens, named ones {attribute: token}, bos, eos, pad, chat template)
_TOKENS = {
    "qwen2_5_vl": (["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                    "<|video_pad|>", "<|endoftext|>"], {}, None, "<|im_end|>", "<|endoftext|>", _CHATML),
    "gemma3": (["<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                "<end_of_image>", "<image_soft_token>"],
               {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"},
               "<bos>", "<end_of_turn>", "<pad>", _GEMMA.replace("{{ IMAGE }}", "<start_of_image>")),
    "gemma4": (["<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>", "<|image>", "<image|>",
                "<|image|>", "<|video|>", "<|audio>", "<audio|>", "<|audio|>"],
               {"boi_token": "<|image>", "eoi_token": "<image|>", "image_token": "<|image|>",
                # the processor wants its audio tokens even for images (transformers 5.24)
                "boa_token": "<|audio>", "eoa_token": "<audio|>", "audio_token": "<|audio|>"},
               "<bos>", "<end_of_turn>", "<pad>", _GEMMA.replace("{{ IMAGE }}", "<|image|>")),
    "mllama": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                "<|image|>", "<|python_tag|>", "<|finetune_right_pad_id|>"], {},
               "<|begin_of_text|>", "<|eot_id|>", "<|finetune_right_pad_id|>", _LLAMA),
}
_TOKENS["qwen3_vl"] = _TOKENS["qwen3_5"] = _TOKENS["qwen2_5_vl"]
_TOKENS["gemma3n"] = (_TOKENS["gemma3"][0] + ["<start_of_audio>", "<end_of_audio>", "<audio_soft_token>"],
                      *_TOKENS["gemma3"][1:])


def _named(named):
    """The named extra specials as a keyword (transformers 4 refuses extra_special_tokens=None)."""
    return {"extra_special_tokens": named} if named else {}


def build_tokenizer(family: str, byte_level: bool = False):
    """A word-level tokenizer of t0..t295 and the roles; `byte_level`: a byte-level BPE trained on
    those words instead (what llama.cpp's converter and runtime can read, for the export tests)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials, named, bos, eos, pad, template = _TOKENS[family]
    words = [f"t{i}" for i in range(WORDS - 4)] + ["system", "user", "assistant", "model"]
    if byte_level:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=WORDS + 256, special_tokens=specials, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator([" ".join(words), "\n".join(words)], trainer)
        return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad,
                                       **_named(named), chat_template=template,
                                       padding_side="right")
    vocab = {word: i for i, word in enumerate(words)}
    vocab.update({token: WORDS + i for i, token in enumerate(specials)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad,
                                   unk_token="t0", **_named(named), chat_template=template,
                                   padding_side="right")


def _ids(tokenizer, *tokens):
    return [tokenizer.convert_tokens_to_ids(t) for t in tokens]


def family_tokens(family: str):
    """(special tokens, {processor attribute: token}, eos, chat template) of a family, for tokenizers made elsewhere."""
    specials, named, _, eos, _, template = _TOKENS[family]
    return specials, named, eos, template


def build_processor(family: str, byte_level: bool = False, tokenizer=None):
    """The family's processor over `tokenizer` (default: build_tokenizer's, byte-level or word-level)."""
    import transformers as t

    from unsloth.models.vision import without_video

    tokenizer = tokenizer or build_tokenizer(family, byte_level)
    template = tokenizer.chat_template
    if family in ("qwen2_5_vl", "qwen3_vl", "qwen3_5"):  # Qwen3.5 ships Qwen3-VL's processor
        patch = 8
        size = {"shortest_edge": IMAGE_SIZE * IMAGE_SIZE, "longest_edge": IMAGE_SIZE * IMAGE_SIZE}
        images = t.Qwen2VLImageProcessorPil(size=size, patch_size=patch, merge_size=2, temporal_patch_size=2)
        cls = without_video(t.Qwen2_5_VLProcessor if family == "qwen2_5_vl" else t.Qwen3VLProcessor)
        return cls(image_processor=images, tokenizer=tokenizer, video_processor=None, chat_template=template)
    if family == "gemma3":
        images = t.Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
        return t.Gemma3Processor(images, tokenizer, chat_template=template, image_seq_length=4)
    if family == "gemma4":
        images = t.Gemma4ImageProcessorPil(patch_size=8, pooling_kernel_size=2, max_soft_tokens=70)
        processor = without_video(t.Gemma4Processor)(t.Gemma4AudioFeatureExtractor(), images, tokenizer, None,
                                                     chat_template=template, image_seq_length=70)
        # it sets the tokenizer's extra special tokens to <|video|> alone: the turn markers stay special
        # (llama.cpp's converter marks only special tokens as control tokens)
        tokenizer.add_special_tokens({"extra_special_tokens": ["<start_of_turn>", "<end_of_turn>"]},
                                     replace_extra_special_tokens=False)
        return processor
    if family == "mllama":
        images = t.MllamaImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, max_image_tiles=1)
        return t.MllamaProcessor(images, tokenizer, chat_template=template)
    raise KeyError(family)


def vision_config(family: str, tokenizer):
    import transformers as t

    vocab = len(tokenizer)
    if family == "qwen2_5_vl":
        image, video, start = _ids(tokenizer, "<|image_pad|>", "<|video_pad|>", "<|vision_start|>")
        return t.Qwen2_5_VLConfig(
            text_config=dict(**TEXT, vocab_size=vocab, rope_scaling={"rope_type": "default", "mrope_section": [2, 2, 4]},
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                               patch_size=8, spatial_merge_size=2, temporal_patch_size=2, window_size=32,
                               fullatt_block_indexes=[1]),
            image_token_id=image, video_token_id=video, vision_start_token_id=start)
    if family == "qwen3_vl":
        image, video, start, end = _ids(tokenizer, "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
        return t.Qwen3VLConfig(
            text_config=dict(**TEXT, head_dim=16, vocab_size=vocab,
                             rope_scaling={"rope_type": "default", "mrope_section": [2, 2, 4], "mrope_interleaved": True},
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                               patch_size=8, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                               deepstack_visual_indexes=[1]),
            image_token_id=image, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end)
    if family == "qwen3_5":  # natively multimodal: Gated DeltaNet and full attention under Qwen3-VL's tower
        image, video, start, end = _ids(tokenizer, "<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
                                        "<|vision_end|>")
        return t.Qwen3_5Config(
            text_config=dict(**TEXT, head_dim=16, vocab_size=vocab, linear_key_head_dim=16, linear_value_head_dim=16,
                             linear_num_key_heads=2, linear_num_value_heads=4,
                             layer_types=["linear_attention", "full_attention"],
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 1.0, "mrope_section": [2, 2, 4],
                                              "mrope_interleaved": True},
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                               patch_size=8, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16),
            image_token_id=image, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end)
    if family == "gemma3":
        boi, eoi, image = _ids(tokenizer, "<start_of_image>", "<end_of_image>", "<image_soft_token>")
        return t.Gemma3Config(
            text_config=dict(**TEXT, head_dim=16, vocab_size=vocab, sliding_window=64,
                             pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                             eos_token_id=tokenizer.eos_token_id),
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                               image_size=IMAGE_SIZE, patch_size=8),
            mm_tokens_per_image=4, boi_token_index=boi, eoi_token_index=eoi, image_token_index=image)
    if family == "gemma4":
        boi, eoi, image, video = _ids(tokenizer, "<|image>", "<image|>", "<|image|>", "<|video|>")
        return t.Gemma4Config(
            text_config=dict(**TEXT, head_dim=16, vocab_size=vocab, sliding_window=64, vocab_size_per_layer_input=vocab,
                             hidden_size_per_layer_input=8, layer_types=["sliding_attention", "full_attention"],
                             pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                             eos_token_id=tokenizer.eos_token_id),
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                               num_key_value_heads=2, head_dim=16, patch_size=8, pooling_kernel_size=2,
                               position_embedding_size=64),
            audio_config=None, boi_token_id=boi, eoi_token_id=eoi, image_token_id=image, video_token_id=video)
    if family == "mllama":
        image = tokenizer.convert_tokens_to_ids("<|image|>")
        return t.MllamaConfig(
            text_config=dict(**{k: v for k, v in TEXT.items() if k != "num_hidden_layers"}, num_hidden_layers=3,
                             cross_attention_layers=[1], vocab_size=vocab, pad_token_id=tokenizer.pad_token_id,
                             bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id),
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1,
                               attention_heads=2, image_size=IMAGE_SIZE, patch_size=8, max_num_tiles=1,
                               intermediate_layers_indices=[0], vision_output_dim=64,
                               supported_aspect_ratios=[[1, 1]]),
            image_token_index=image)
    raise KeyError(family)


def add_audio_tower(config, tokenizer):
    """A Gemma 4 config given a tiny audio tower beside its vision tower, as E2B / E4B ship."""
    from transformers import Gemma4AudioConfig

    config.audio_config = Gemma4AudioConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                            output_proj_dims=48)
    config.audio_token_id, config.boa_token_id, config.eoa_token_id = (
        tokenizer.convert_tokens_to_ids(t) for t in ("<|audio|>", "<|audio>", "<audio|>"))
    return config


def tiny_vision_model(family: str, seed: int = 0):
    """(model, processor): random weights in float32."""
    from transformers import AutoModelForImageTextToText

    processor = build_processor(family)
    config = vision_config(family, processor.tokenizer)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # Some towers start closed (Gemma 3's projection weight, mllama's cross-attention gates are zeros
        # at init): random values, as a trained checkpoint has, so images reach the language model.
        for name, p in model.named_parameters():
            if not p.any() and "bias" not in name:
                p.normal_(0.0, 0.5)
    return model.eval(), processor


def save_tiny_vision(family: str, directory) -> str:
    """A loadable folder: the model, its processor (tokenizer, image processor, chat template)."""
    model, processor = tiny_vision_model(family)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return str(directory)


def gemma3n_text_config(tokenizer):
    """Gemma 3n's language model at toy sizes with each of its parts: AltUp over 2 streams, LAuReL,
    per-layer inputs, the last 2 of 4 layers reading the KV of earlier ones, and activation sparsity
    (a top-k MLP) in its first layer."""
    from transformers import Gemma3nTextConfig

    vocab = len(tokenizer)
    return Gemma3nTextConfig(
        **{k: v for k, v in TEXT.items() if k != "num_hidden_layers"}, num_hidden_layers=4, head_dim=16,
        vocab_size=vocab, vocab_size_per_layer_input=vocab, hidden_size_per_layer_input=8, altup_num_inputs=2,
        laurel_rank=4, num_kv_shared_layers=2, sliding_window=64, layer_types=["sliding_attention", "full_attention"] * 2,
        activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0], pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)


def gemma3n_config(tokenizer):
    """The whole Gemma 3n (Gemma3nForConditionalGeneration): the language model above, a tiny audio
    tower, and the vision tower's config (a timm MobileNetV5: transformers builds it only with timm)."""
    from transformers import Gemma3nConfig

    boi, eoi, image, boa, eoa, audio = _ids(tokenizer, "<start_of_image>", "<end_of_image>", "<image_soft_token>",
                                            "<start_of_audio>", "<end_of_audio>", "<audio_soft_token>")
    return Gemma3nConfig(text_config=gemma3n_text_config(tokenizer).to_dict(),
                         vision_config=dict(hidden_size=64, vocab_size=8, vocab_offset=len(tokenizer)),
                         audio_config=dict(hidden_size=32, conf_num_hidden_layers=1, conf_num_attention_heads=2,
                                           vocab_size=8, vocab_offset=len(tokenizer) + 8),
                         boi_token_id=boi, eoi_token_id=eoi, image_token_id=image, boa_token_id=boa,
                         eoa_token_id=eoa, audio_token_id=audio, vision_soft_tokens_per_image=4)


def save_tiny_gemma3n_text(directory, seed: int = 0) -> str:
    """A loadable folder of Gemma 3n's language model alone (Gemma3nForCausalLM) and its tokenizer."""
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer("gemma3n")
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(gemma3n_text_config(tokenizer), dtype=torch.float32).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def images(n: int = 2, seed: int = 0):
    """`n` RGB PIL images of random colours."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, (IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)) for _ in range(n)]
